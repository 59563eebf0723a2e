//! An independent statement of the cache's storage policy, shared by the conformance suite and
//! the model-level tests: per sequence, which positions are coded (sink, whole blocks of codes,
//! recent rows) and the value each holds as the cache stores it — f16-rounded, or decoded from the
//! CPU codec's codes once coded — with an f64 attention over it.

use std::sync::Arc;

use half::f16;
use rayon::prelude::*;

use veloq::codec::block::BlockCodec;

/// The storage policy knobs of a coded cache.
#[derive(Clone, Copy, Debug)]
pub struct Window {
    pub sink: usize,
    pub keep: usize,
    pub block: usize,
}

/// The library's default window (`WindowConfig::default()`): 4 sinks, 16–23 recent rows, blocks
/// of 8.
pub const DEFAULT_WINDOW: Window = Window { sink: 4, keep: 16, block: 8 };

pub fn round_f16(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| f16::from_f32(v).to_f32()).collect()
}

/// What each position of each sequence should hold: its value (f32 of the stored f16, or decoded
/// from codes) and whether it is coded.
pub struct Shadow {
    pub window: Window,
    pub sliding: Option<usize>,
    pub codecs: Option<(Arc<dyn BlockCodec>, Arc<dyn BlockCodec>)>,
    /// Per slot: keys and values `[positions][kv·D]`, and the coded count after the sink.
    pub keys: Vec<Vec<Vec<f32>>>,
    pub values: Vec<Vec<Vec<f32>>>,
    pub coded: Vec<usize>,
    /// Per slot: the first position a truncation brought back from codes, while it is held.
    pub restored: Vec<Option<usize>>,
}

impl Shadow {
    pub fn new(
        slots: usize,
        window: Window,
        sliding: Option<usize>,
        codecs: Option<(Arc<dyn BlockCodec>, Arc<dyn BlockCodec>)>,
    ) -> Self {
        Shadow {
            window,
            sliding,
            codecs,
            keys: vec![Vec::new(); slots],
            values: vec![Vec::new(); slots],
            coded: vec![0; slots],
            restored: vec![None; slots],
        }
    }

    pub fn sink(&self, slot: usize) -> usize {
        self.window.sink.min(self.keys[slot].len())
    }

    /// New rows (`row` = kv·D floats each) appended to `slot`, stored as f16.
    pub fn push(&mut self, slot: usize, keys: &[f32], values: &[f32], row: usize) {
        for (k, v) in keys.chunks_exact(row).zip(values.chunks_exact(row)) {
            self.keys[slot].push(round_f16(k));
            self.values[slot].push(round_f16(v));
        }
    }

    /// After a commit: code whole blocks until `keep`–`keep + block − 1` recent positions remain.
    pub fn commit(&mut self, slot: usize) {
        let Some((kc, vc)) = self.codecs.clone() else { return };
        let (w, len, sink) = (self.window, self.keys[slot].len(), self.sink(slot));
        if len < w.sink {
            return;
        }
        let recent = len - sink - self.coded[slot];
        if recent < w.keep + w.block {
            return;
        }
        let n = (recent - w.keep) / w.block * w.block;
        for b0 in (self.coded[slot]..self.coded[slot] + n).step_by(w.block) {
            let p0 = sink + b0;
            for (rows, codec) in [(&mut self.keys[slot], &kc), (&mut self.values[slot], &vc)] {
                let flat: Vec<f32> = rows[p0..p0 + w.block].concat();
                let mut out = vec![0.0f32; flat.len()];
                codec.decode(&codec.encode_vec(&flat).unwrap(), &mut out).unwrap();
                let row = flat.len() / w.block;
                for i in 0..w.block {
                    rows[p0 + i] = out[i * row..(i + 1) * row].to_vec();
                }
            }
        }
        self.coded[slot] += n;
    }

    /// Slot `to` holds what `from` holds (a fork).
    pub fn fork(&mut self, from: usize, to: usize) {
        self.keys[to] = self.keys[from].clone();
        self.values[to] = self.values[from].clone();
        self.coded[to] = self.coded[from];
        self.restored[to] = self.restored[from];
    }

    /// A truncation to `len` positions leaves what growth to `len` leaves: as many coded
    /// positions as commits would have coded, and those past them back as f16 rows.
    pub fn truncate(&mut self, slot: usize, len: usize) {
        self.keys[slot].truncate(len);
        self.values[slot].truncate(len);
        self.restored[slot] = self.restored[slot].filter(|&p| p < len);
        let (w, sink) = (self.window, self.sink(slot));
        let keep = len.saturating_sub(w.sink + w.keep) / w.block * w.block;
        if keep < self.coded[slot] {
            let end = (sink + self.coded[slot]).min(len);
            if sink + keep < end {
                self.restored[slot] = Some(self.restored[slot].map_or(sink + keep, |p| p.min(sink + keep)));
            }
            for p in sink + keep..end {
                self.keys[slot][p] = round_f16(&self.keys[slot][p]);
                self.values[slot][p] = round_f16(&self.values[slot][p]);
            }
            self.coded[slot] = keep;
        }
    }

    /// f64 attention of `q` (`[t, hq, D]`, queries at positions `start..`) over what `slot`
    /// holds, causal (and sliding, for a sliding shadow), scores scaled by `scale`; `kv` heads of
    /// `d` channels, query head `h` reading kv head `h / (hq / kv)`.
    pub fn attend(
        &self,
        slot: usize,
        start: usize,
        q: &[f32],
        (hq, kv, d): (usize, usize, usize),
        scale: f64,
    ) -> Vec<f64> {
        let g = hq / kv;
        let (keys, values) = (&self.keys[slot], &self.values[slot]);
        let mut out = vec![0.0f64; q.len()];
        // One (query token, query head) per task: the model-level tests attend long real prompts.
        out.par_chunks_mut(d).zip(q.par_chunks(d)).enumerate().for_each(|(row, (o, qv))| {
            let (p, h) = (start + row / hq, (row % hq) / g);
            let lo = self.sliding.map_or(0, |w| (p + 1).saturating_sub(w));
            let scores: Vec<f64> = (lo..=p)
                .map(|pos| {
                    scale * qv.iter().zip(&keys[pos][h * d..][..d]).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>()
                })
                .collect();
            let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let mut total = 0.0;
            for (pos, s) in (lo..=p).zip(scores) {
                let w = (s - m).exp();
                total += w;
                o.iter_mut().zip(&values[pos][h * d..][..d]).for_each(|(o, &x)| *o += w * x as f64);
            }
            o.iter_mut().for_each(|o| *o /= total);
        });
        out
    }
}
