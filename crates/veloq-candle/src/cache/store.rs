//! Storage shared by the compressed caches: the first `sink` positions in f16 (attention sinks: the
//! model parks attention on the first tokens, and their keys are outliers no codebook fits), then
//! encoded blocks, then an f16 window of the most recent positions. The window is flushed to codes a block at a time, so a codec runs once per
//! block, not once per token. What the bytes mean is the codec's business ([`BlockCodec`]).

use std::sync::Arc;

use half::f16;

use veloq::codec::block::BlockCodec;

use candle_core::Tensor;

use super::dense::{attend_dense, widen};
use crate::error::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowConfig {
    /// Recent positions kept in f16 after a flush.
    pub window: usize,
    /// Positions encoded per flush (a multiple of 8 and of the codecs' block size).
    pub flush_block: usize,
    /// First positions kept in f16 for good (attention sinks).
    pub sink: usize,
}

impl Default for WindowConfig {
    /// 16–23 recent positions exact, codes written 8 positions at a time, 4 sink positions: the
    /// window's storage (24 positions) stays small next to the codes at 1k tokens.
    fn default() -> Self {
        Self { window: 16, flush_block: 8, sink: 4 }
    }
}

pub struct CodedStore {
    pub keys: Arc<dyn BlockCodec>,
    pub values: Arc<dyn BlockCodec>,
    pub cfg: WindowConfig,
    pub n_kv: usize,
    pub head_dim: usize,
    /// Token-major f16 rows of the sink positions (at most `cfg.sink`).
    pub sink_k: Vec<f16>,
    pub sink_v: Vec<f16>,
    /// Positions stored as codes (a multiple of `flush_block`), after the sink.
    pub coded: usize,
    pub key_blocks: Vec<Box<[u8]>>,
    pub value_blocks: Vec<Box<[u8]>>,
    /// Token-major f16 `[positions, n_kv, head_dim]` of the window.
    pub window_k: Vec<f16>,
    pub window_v: Vec<f16>,
}

impl CodedStore {
    pub fn new(keys: Arc<dyn BlockCodec>, values: Arc<dyn BlockCodec>, cfg: WindowConfig) -> Result<Self> {
        let b = cfg.flush_block;
        if b == 0 || b % 8 != 0 || b % keys.block_tokens() != 0 || b % values.block_tokens() != 0 {
            return Err(Error::Config(format!(
                "flush_block {b} must be a positive multiple of 8, {} and {}",
                keys.block_tokens(),
                values.block_tokens()
            )));
        }
        if keys.n_heads() != values.n_heads() || keys.head_dim() != values.head_dim() {
            return Err(Error::Config("key and value codecs disagree on geometry".into()));
        }
        let (n_kv, head_dim) = (keys.n_heads(), keys.head_dim());
        let cap = (cfg.window + b) * n_kv * head_dim;
        Ok(Self {
            keys,
            values,
            cfg,
            n_kv,
            head_dim,
            sink_k: Vec::new(),
            sink_v: Vec::new(),
            coded: 0,
            key_blocks: Vec::new(),
            value_blocks: Vec::new(),
            window_k: Vec::with_capacity(cap),
            window_v: Vec::with_capacity(cap),
        })
    }

    pub fn row(&self) -> usize {
        self.n_kv * self.head_dim
    }
    pub fn window_len(&self) -> usize {
        self.window_k.len() / self.row()
    }
    pub fn sink_len(&self) -> usize {
        self.sink_k.len() / self.row()
    }
    pub fn len(&self) -> usize {
        self.sink_len() + self.coded + self.window_len()
    }

    /// Appends token-major f32 rows to the window, checking the geometry.
    pub fn push(&mut self, heads: usize, head_dim: usize, k: &[f32], v: &[f32]) -> Result<()> {
        if heads != self.n_kv || head_dim != self.head_dim {
            return Err(Error::Config(format!("cache built for {}×{}, got {heads}×{head_dim}", self.n_kv, self.head_dim)));
        }
        let row = self.row();
        let to_sink = (self.cfg.sink - self.sink_len()).min(k.len() / row) * row;
        self.sink_k.extend(k[..to_sink].iter().map(|&x| f16::from_f32(x)));
        self.sink_v.extend(v[..to_sink].iter().map(|&x| f16::from_f32(x)));
        self.window_k.extend(k[to_sink..].iter().map(|&x| f16::from_f32(x)));
        self.window_v.extend(v[to_sink..].iter().map(|&x| f16::from_f32(x)));
        Ok(())
    }

    /// Encodes the oldest window positions, a block at a time, until the window holds fewer than
    /// `window + flush_block` positions; then gives back any capacity a long prefill grew.
    pub fn flush(&mut self) -> Result<()> {
        let (b, row) = (self.cfg.flush_block, self.row());
        let wl = self.window_len();
        if wl < self.cfg.window + b {
            return Ok(());
        }
        let blocks = (wl - self.cfg.window) / b;
        let n = b * row;
        let mut buf = vec![0.0f32; n];
        for i in 0..blocks {
            widen(&self.window_k[i * n..(i + 1) * n], &mut buf);
            self.key_blocks.push(self.keys.encode_vec(&buf)?.into_boxed_slice());
            widen(&self.window_v[i * n..(i + 1) * n], &mut buf);
            self.value_blocks.push(self.values.encode_vec(&buf)?.into_boxed_slice());
        }
        self.window_k.drain(..blocks * n);
        self.window_v.drain(..blocks * n);
        self.coded += blocks * b;
        let cap = (self.cfg.window + b) * row;
        self.window_k.shrink_to(cap);
        self.window_v.shrink_to(cap);
        Ok(())
    }

    /// Everything cached, decoded to token-major f32 (sink, codes, window).
    pub fn decode_all(&self, keys: bool) -> Result<Vec<f32>> {
        let (codec, blocks, sink, window) = if keys {
            (&self.keys, &self.key_blocks, &self.sink_k, &self.window_k)
        } else {
            (&self.values, &self.value_blocks, &self.sink_v, &self.window_v)
        };
        let per = self.cfg.flush_block * self.row();
        let mut out = vec![0.0f32; sink.len() + self.coded * self.row() + window.len()];
        let (head, rest) = out.split_at_mut(sink.len());
        widen(sink, head);
        let (coded, win) = rest.split_at_mut(self.coded * self.row());
        for (blk, o) in blocks.iter().zip(coded.chunks_exact_mut(per)) {
            codec.decode(blk, o)?;
        }
        widen(window, win);
        Ok(out)
    }

    /// Attention of several queries over everything cached, decoded (prefill, teacher-forced
    /// evaluation, and the baselines' only path).
    pub fn attend_decoded(&self, q: &Tensor, scale: f64) -> Result<Tensor> {
        attend_dense(q, self.decode_all(true)?, self.decode_all(false)?, self.n_kv, scale)
    }

    /// Bytes held: encoded blocks, window capacity, the codecs' own tables.
    pub fn resident_bytes(&self) -> usize {
        let codes: usize = self.key_blocks.iter().chain(&self.value_blocks).map(|b| b.len()).sum();
        let window = (self.window_k.capacity() + self.window_v.capacity() + self.sink_k.capacity() + self.sink_v.capacity()) * 2;
        codes + window + self.keys.resident_bytes() + self.values.resident_bytes()
    }

    pub fn truncate(&mut self, len: usize) -> Result<()> {
        if len > self.len() {
            return Err(Error::Config(format!("truncate to {len} beyond the {} cached positions", self.len())));
        }
        let row = self.row();
        let sink = self.sink_len();
        if len <= sink {
            self.sink_k.truncate(len * row);
            self.sink_v.truncate(len * row);
            (self.coded, self.window_k, self.window_v) = (0, Vec::new(), Vec::new());
            self.key_blocks.clear();
            self.value_blocks.clear();
            return Ok(());
        }
        let len = len - sink;
        if len >= self.coded {
            self.window_k.truncate((len - self.coded) * row);
            self.window_v.truncate((len - self.coded) * row);
            return Ok(());
        }
        // Cut inside the codes: keep whole blocks, decode the kept part of the cut block back
        // into the window (approximate values: those positions were already quantized).
        let b = self.cfg.flush_block;
        let keep = len / b;
        let part = len - keep * b;
        let mut wk = Vec::with_capacity(self.window_k.capacity());
        let mut wv = Vec::with_capacity(self.window_v.capacity());
        if part > 0 {
            let mut buf = vec![0.0f32; b * row];
            self.keys.decode(&self.key_blocks[keep], &mut buf)?;
            wk.extend(buf[..part * row].iter().map(|&x| f16::from_f32(x)));
            self.values.decode(&self.value_blocks[keep], &mut buf)?;
            wv.extend(buf[..part * row].iter().map(|&x| f16::from_f32(x)));
        }
        self.key_blocks.truncate(keep);
        self.value_blocks.truncate(keep);
        self.coded = keep * b;
        self.window_k = wk;
        self.window_v = wv;
        Ok(())
    }
}
