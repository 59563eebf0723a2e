//! The VecInfer cache: keys and values as packed codebook indices, plus a small f16 window of the
//! most recent positions that is flushed to codes in blocks (so the quantizer runs once per block,
//! not once per token).
//!
//! Decode attention never rebuilds keys: the query is moved into code space (q̃ = H(s ⊙ q)), a
//! lookup table LUT[j][c] = q̃_j · C_j[c] is built once per query head, and each cached position
//! scores as Σ_j LUT[j][code_j]. Values are accumulated per centroid (W[j][c] += p_t) and decoded
//! once per head at the end, then rotated back. The window is attended exactly and merged in the
//! same softmax. Prefill attends densely over the window (the prompt is in it) and flushes after,
//! so the prompt's own attention is exact.

use std::sync::Arc;

use candle_core::Tensor;
use half::f16;
use rayon::prelude::*;

use veloq::codec::pack;
use veloq::codec::vecinfer::VecInferCodec;

use super::dense::{attend_dense, axpy, dot, output, query_rows, softmax, widen};
use super::{token_major, LayerCache};
use crate::error::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VecInferCacheConfig {
    /// Recent positions kept in f16 after a flush.
    pub window: usize,
    /// Positions quantized per flush (a multiple of 8, so blocks start on byte boundaries).
    pub flush_block: usize,
}

impl Default for VecInferCacheConfig {
    fn default() -> Self {
        Self { window: 16, flush_block: 16 }
    }
}

pub struct VecInferCache {
    keys: Arc<VecInferCodec>,
    values: Arc<VecInferCodec>,
    /// Codebooks transposed to `[books][sub_dim][centroids]`, so building the lookup table and
    /// decoding the per-centroid value sums run along contiguous centroid rows (SIMD-friendly).
    keys_t: Vec<f32>,
    values_t: Vec<f32>,
    cfg: VecInferCacheConfig,
    n_kv: usize,
    head_dim: usize,
    /// Positions stored as codes (always a multiple of `flush_block`).
    coded: usize,
    key_codes: Vec<Box<[u8]>>,
    value_codes: Vec<Box<[u8]>>,
    /// Token-major f16 `[positions, n_kv, head_dim]` of the window.
    window_k: Vec<f16>,
    window_v: Vec<f16>,
}

impl VecInferCache {
    pub fn new(keys: Arc<VecInferCodec>, values: Arc<VecInferCodec>, cfg: VecInferCacheConfig) -> Result<Self> {
        if cfg.flush_block == 0 || cfg.flush_block % 8 != 0 {
            return Err(Error::Config(format!("flush_block {} must be a positive multiple of 8", cfg.flush_block)));
        }
        if keys.n_heads() != values.n_heads() || keys.head_dim() != values.head_dim() {
            return Err(Error::Config("key and value codecs disagree on geometry".into()));
        }
        let (n_kv, head_dim) = (keys.n_heads(), keys.head_dim());
        let row = n_kv * head_dim;
        let cap = (cfg.window + cfg.flush_block) * row;
        Ok(Self {
            keys_t: transposed(&keys),
            values_t: transposed(&values),
            keys,
            values,
            cfg,
            n_kv,
            head_dim,
            coded: 0,
            key_codes: Vec::new(),
            value_codes: Vec::new(),
            window_k: Vec::with_capacity(cap),
            window_v: Vec::with_capacity(cap),
        })
    }

    fn row(&self) -> usize {
        self.n_kv * self.head_dim
    }
    fn window_len(&self) -> usize {
        self.window_k.len() / self.row()
    }

    /// Quantizes the oldest window positions, a block at a time, until the window holds fewer
    /// than `window + flush_block` positions; then gives back any capacity a long prefill grew.
    fn flush(&mut self) -> Result<()> {
        let (b, row) = (self.cfg.flush_block, self.row());
        let wl = self.window_len();
        if wl < self.cfg.window + b {
            return Ok(());
        }
        let blocks = (wl - self.cfg.window) / b;
        let n = b * row;
        for i in 0..blocks {
            self.key_codes.push(self.keys.encode_vec(&self.window_k[i * n..(i + 1) * n])?.into_boxed_slice());
            self.value_codes.push(self.values.encode_vec(&self.window_v[i * n..(i + 1) * n])?.into_boxed_slice());
        }
        self.window_k.drain(..blocks * n);
        self.window_v.drain(..blocks * n);
        self.coded += blocks * b;
        let cap = (self.cfg.window + b) * row;
        self.window_k.shrink_to(cap);
        self.window_v.shrink_to(cap);
        Ok(())
    }

    /// Decodes all coded positions (prefill only): token-major f32.
    fn decode_codes(&self, codec: &VecInferCodec, blocks: &[Box<[u8]>]) -> Result<Vec<f32>> {
        let per = self.cfg.flush_block * self.row();
        let mut out = vec![0.0f32; self.coded * self.row()];
        for (blk, o) in blocks.iter().zip(out.chunks_exact_mut(per)) {
            codec.decode(blk, o)?;
        }
        Ok(out)
    }

    fn widened(window: &[f16]) -> Vec<f32> {
        let mut out = vec![0.0f32; window.len()];
        widen(window, &mut out);
        out
    }

    /// Code `j` of kv-head `h` at coded position `t`.
    #[inline]
    fn code(&self, blocks: &[Box<[u8]>], bits: u32, m: usize, t: usize, h: usize, j: usize) -> usize {
        let b = self.cfg.flush_block;
        let idx = ((t % b) * self.n_kv + h) * m + j;
        pack::get(&blocks[t / b], bits, idx) as usize
    }

    /// Single-query attention for every query head over codes + window.
    fn attend_decode(&self, q: &Tensor, scale: f64) -> Result<Tensor> {
        let (_, hq, _, d) = q.dims4()?;
        let qr = query_rows(q)?;
        let g = hq / self.n_kv;
        let (kc, vc) = (&*self.keys, &*self.values);
        let (m, sd) = (kc.subspaces(), kc.shape().sub_dim);
        let (kk, vk) = (kc.shape().centroids(), vc.shape().centroids());
        let (mv, sdv) = (vc.subspaces(), vc.shape().sub_dim);
        let (kbits, vbits) = (kc.shape().bits, vc.shape().bits);
        let wn = self.window_len();
        let wk = Self::widened(&self.window_k);
        let wv = Self::widened(&self.window_v);
        let (coded, row, bsz) = (self.coded, self.row(), self.cfg.flush_block);
        let mut out = vec![0.0f32; hq * d];
        out.par_chunks_mut(d).enumerate().for_each(|(qh, o)| {
            let h = qh / g;
            let qv: Vec<f32> = qr[qh * d..(qh + 1) * d].iter().map(|x| x * scale as f32).collect();
            let mut p = vec![0.0f32; coded + wn];
            if coded > 0 {
                let mut qt = vec![0.0f32; d];
                kc.transform_query(h, &qv, &mut qt);
                let mut lut = vec![0.0f32; m * kk];
                for (j, row) in lut.chunks_exact_mut(kk).enumerate() {
                    let bt = book_t(&self.keys_t, kc, j);
                    for d in 0..sd {
                        let qd = qt[j * sd + d];
                        row.iter_mut().zip(&bt[d * kk..(d + 1) * kk]).for_each(|(l, c)| *l += c * qd);
                    }
                }
                if kbits == 8 {
                    // Fast path: one byte per code, a block's codes for head h are contiguous rows.
                    for (t, pv) in p[..coded].iter_mut().enumerate() {
                        let codes = &self.key_codes[t / bsz][((t % bsz) * self.n_kv + h) * m..][..m];
                        let mut s = 0.0;
                        for (j, &c) in codes.iter().enumerate() {
                            s += lut[j * kk + c as usize];
                        }
                        *pv = s;
                    }
                } else {
                    for (t, pv) in p[..coded].iter_mut().enumerate() {
                        *pv = (0..m).map(|j| lut[j * kk + self.code(&self.key_codes, kbits, m, t, h, j)]).sum();
                    }
                }
            }
            for (i, pv) in p[coded..].iter_mut().enumerate() {
                *pv = dot(&qv, &wk[i * row + h * d..][..d]);
            }
            softmax(&mut p);
            if coded > 0 {
                let mut acc = vec![0.0f32; mv * vk];
                if vbits == 8 {
                    for (t, &pv) in p[..coded].iter().enumerate() {
                        let codes = &self.value_codes[t / bsz][((t % bsz) * self.n_kv + h) * mv..][..mv];
                        for (j, &c) in codes.iter().enumerate() {
                            acc[j * vk + c as usize] += pv;
                        }
                    }
                } else {
                    for (t, &pv) in p[..coded].iter().enumerate() {
                        for j in 0..mv {
                            acc[j * vk + self.code(&self.value_codes, vbits, mv, t, h, j)] += pv;
                        }
                    }
                }
                let mut rot = vec![0.0f32; d];
                for j in 0..mv {
                    let bt = book_t(&self.values_t, vc, j);
                    for dd in 0..sdv {
                        rot[j * sdv + dd] = dot(&acc[j * vk..(j + 1) * vk], &bt[dd * vk..(dd + 1) * vk]);
                    }
                }
                vc.transform().inverse(h, &mut rot);
                o.copy_from_slice(&rot);
            }
            for (i, &pv) in p[coded..].iter().enumerate() {
                axpy(pv, &wv[i * row + h * d..][..d], o);
            }
        });
        output(out, hq, d, q.device())
    }
}

/// All codebooks of `codec`, each transposed to `[sub_dim][centroids]`, concatenated.
fn transposed(codec: &VecInferCodec) -> Vec<f32> {
    let (k, sd) = (codec.shape().centroids(), codec.shape().sub_dim);
    let mut out = Vec::with_capacity(codec.books().books().len() * k * sd);
    for b in codec.books().books() {
        for d in 0..sd {
            out.extend((0..k).map(|c| b.centroid(c)[d]));
        }
    }
    out
}

/// The transposed codebook that sub-space `j` uses.
#[inline]
fn book_t<'a>(all: &'a [f32], codec: &VecInferCodec, j: usize) -> &'a [f32] {
    let size = codec.shape().centroids() * codec.shape().sub_dim;
    let b = codec.books().book_index(j);
    &all[b * size..(b + 1) * size]
}

impl LayerCache for VecInferCache {
    fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        let (h, _, d, kr) = token_major(k)?;
        let (_, _, _, vr) = token_major(v)?;
        if h != self.n_kv || d != self.head_dim {
            return Err(Error::Config(format!("VecInfer cache calibrated for {}×{}, got {h}×{d}", self.n_kv, self.head_dim)));
        }
        self.window_k.extend(kr.iter().map(|&x| f16::from_f32(x)));
        self.window_v.extend(vr.iter().map(|&x| f16::from_f32(x)));
        Ok(())
    }

    fn attend(&mut self, q: &Tensor, scale: f64) -> Result<Tensor> {
        let t = q.dim(2)?;
        let y = if t > 1 {
            let mut k = self.decode_codes(&self.keys, &self.key_codes)?;
            k.extend(Self::widened(&self.window_k));
            let mut v = self.decode_codes(&self.values, &self.value_codes)?;
            v.extend(Self::widened(&self.window_v));
            attend_dense(q, k, v, self.n_kv, scale)?
        } else {
            self.attend_decode(q, scale)?
        };
        self.flush()?;
        Ok(y)
    }

    fn len(&self) -> usize {
        self.coded + self.window_len()
    }

    fn resident_bytes(&self) -> usize {
        let codes: usize = self.key_codes.iter().chain(&self.value_codes).map(|b| b.len()).sum();
        let window = (self.window_k.capacity() + self.window_v.capacity()) * 2;
        let meta: usize = [&self.keys, &self.values]
            .iter()
            .map(|c| c.books().resident_bytes() + c.smooth().map_or(0, |s| s.as_slice().len() * 4))
            .sum();
        codes + window + meta
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        if len > self.len() {
            return Err(Error::Config(format!("truncate to {len} beyond the {} cached positions", self.len())));
        }
        let row = self.row();
        if len >= self.coded {
            self.window_k.truncate((len - self.coded) * row);
            self.window_v.truncate((len - self.coded) * row);
            return Ok(());
        }
        // Cut inside the codes: keep whole blocks, decode the kept part of the cut block back
        // into the window (approximate values: those positions were already quantized).
        let b = self.cfg.flush_block;
        let keep_blocks = len / b;
        let part = len - keep_blocks * b;
        let mut wk = Vec::with_capacity(self.window_k.capacity());
        let mut wv = Vec::with_capacity(self.window_v.capacity());
        if part > 0 {
            let mut buf = vec![0.0f32; b * row];
            self.keys.decode(&self.key_codes[keep_blocks], &mut buf)?;
            wk.extend(buf[..part * row].iter().map(|&x| f16::from_f32(x)));
            self.values.decode(&self.value_codes[keep_blocks], &mut buf)?;
            wv.extend(buf[..part * row].iter().map(|&x| f16::from_f32(x)));
        }
        self.key_codes.truncate(keep_blocks);
        self.value_codes.truncate(keep_blocks);
        self.coded = keep_blocks * b;
        self.window_k = wk;
        self.window_v = wv;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use veloq::calibrate::{train_codec, KMeansConfig};
    use veloq::codec::codebook::PqShape;
    use veloq::codec::vecinfer::CodecSpec;

    fn randn(n: usize, seed: u64) -> Vec<f32> {
        // Box–Muller over a xorshift stream: fresh, non-zero Gaussian data.
        let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
        let mut u = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        (0..n).map(|_| ((-2.0 * u().ln()).sqrt() * (2.0 * std::f64::consts::PI * u()).cos()) as f32).collect()
    }

    /// The lookup-table decode path equals dense attention over the decoded codes + window, for
    /// 8-bit and packed 6-bit codes, GQA, and lengths that leave a partial window.
    #[test]
    fn lut_decode_matches_dense_attention_over_decoded_keys() {
        let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
        let dev = Device::Cpu;
        let (hkv, hq, d) = (2, 6, 64);
        for (bits, sd, len) in [(8u32, 4usize, 77usize), (6, 2, 41), (8, 8, 130)] {
            let shape = PqShape::new(sd, bits).unwrap();
            let train = randn(400 * hkv * d, seed);
            let (kc, _) = train_codec(&train, hkv, d, &CodecSpec::keys(shape), &KMeansConfig::new(1 << bits, 1)).unwrap();
            let (vc, _) = train_codec(&train, hkv, d, &CodecSpec::values(shape), &KMeansConfig::new(1 << bits, 2)).unwrap();
            let mut cache = VecInferCache::new(Arc::new(kc), Arc::new(vc), VecInferCacheConfig { window: 8, flush_block: 8 }).unwrap();
            let k = Tensor::from_vec(randn(hkv * len * d, seed + 1), (1, hkv, len, d), &dev).unwrap();
            let v = Tensor::from_vec(randn(hkv * len * d, seed + 2), (1, hkv, len, d), &dev).unwrap();
            cache.append(&k, &v).unwrap();
            cache.flush().unwrap();
            assert!(cache.coded > 0 && cache.window_len() > 0);
            let q = Tensor::from_vec(randn(hq * d, seed + 3), (1, hq, 1, d), &dev).unwrap();
            let got = cache.attend_decode(&q, 0.125).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let mut kd = cache.decode_codes(&cache.keys, &cache.key_codes).unwrap();
            kd.extend(VecInferCache::widened(&cache.window_k));
            let mut vd = cache.decode_codes(&cache.values, &cache.value_codes).unwrap();
            vd.extend(VecInferCache::widened(&cache.window_v));
            let want = attend_dense(&q, kd, vd, hkv, 0.125).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let err: f32 = got.iter().zip(&want).map(|(a, b)| (a - b).powi(2)).sum::<f32>().sqrt();
            let norm: f32 = want.iter().map(|a| a * a).sum::<f32>().sqrt();
            assert!(err <= 1e-4 * norm, "seed {seed} bits {bits}: rel err {}", err / norm);
        }
    }
}
