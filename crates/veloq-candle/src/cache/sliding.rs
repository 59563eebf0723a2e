//! Sliding-window layers (Gemma 3's local attention): a query sees only the `window` most recent
//! positions, itself included. The layer therefore keeps at most `window − 1` past positions, in
//! f16, whatever method the global layers use: its memory is bounded by the window, so coding it
//! would save little and cost accuracy.

use candle_core::Tensor;
use half::f16;

use super::dense::{attend_dense_window, widen};
use super::{kv_rows, LayerCache};
use crate::error::{Error, Result};

pub struct SlidingCache {
    n_kv: usize,
    head_dim: usize,
    window: usize,
    /// Positions seen since the start (what `len` reports: positions, not rows held).
    seen: usize,
    /// Token-major `[rows, n_kv, head_dim]` of the last rows seen.
    keys: Vec<f16>,
    values: Vec<f16>,
}

impl SlidingCache {
    pub fn new(n_kv: usize, head_dim: usize, window: usize) -> Result<Self> {
        if window == 0 {
            return Err(Error::Config("a sliding window of 0 positions".into()));
        }
        Ok(Self { n_kv, head_dim, window, seen: 0, keys: Vec::new(), values: Vec::new() })
    }

    fn row(&self) -> usize {
        self.n_kv * self.head_dim
    }

    fn rows(&self) -> usize {
        self.keys.len() / self.row()
    }

    /// Drops all but the last `keep` rows.
    fn keep_last(&mut self, keep: usize) {
        let drop = self.rows().saturating_sub(keep) * self.row();
        self.keys.drain(..drop);
        self.values.drain(..drop);
    }
}

impl LayerCache for SlidingCache {
    fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        let (t, kr, vr) = kv_rows(k, v, self.n_kv, self.head_dim, "sliding cache")?;
        // The first new position looks back window − 1 positions; older rows are never seen again.
        self.keep_last(self.window - 1);
        self.keys.extend(kr.iter().map(|&x| f16::from_f32(x)));
        self.values.extend(vr.iter().map(|&x| f16::from_f32(x)));
        self.seen += t;
        Ok(())
    }

    fn attend(&mut self, q: &Tensor, scale: f64) -> Result<Tensor> {
        let mut k = vec![0.0f32; self.keys.len()];
        let mut v = vec![0.0f32; self.values.len()];
        widen(&self.keys, &mut k);
        widen(&self.values, &mut v);
        attend_dense_window(q, k, v, self.n_kv, scale, Some(self.window))
    }

    fn len(&self) -> usize {
        self.seen
    }

    fn resident_bytes(&self) -> usize {
        (self.keys.capacity() + self.values.capacity()) * 2
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        if len >= self.seen {
            return Ok(());
        }
        let back = self.seen - len;
        let left = self.rows().saturating_sub(back);
        // After truncating, the next position must still find its window − 1 predecessors.
        if len > 0 && left < (self.window - 1).min(len) {
            return Err(Error::Config(format!(
                "cannot truncate a sliding-window layer from {} to {len} positions: it no longer holds them",
                self.seen
            )));
        }
        let row = self.row();
        self.keys.truncate(left * row);
        self.values.truncate(left * row);
        self.seen = len;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::Fp16Cache;
    use candle_core::Device;

    fn randn(shape: &[usize], seed: u64) -> Tensor {
        let n = shape.iter().product();
        Tensor::from_vec(crate::testing::randn(n, seed, false), shape, &Device::Cpu).unwrap()
    }

    /// Token by token, the sliding cache equals full attention over just the last `window`
    /// positions (an fp16 cache fed only those), and holds no more than `window` rows.
    #[test]
    fn sliding_matches_full_attention_over_the_window() {
        let (nkv, hq, d, w) = (2, 4, 32, 5);
        let mut sl = SlidingCache::new(nkv, d, w).unwrap();
        let ks: Vec<Tensor> = (0..13).map(|i| randn(&[1, nkv, 1, d], 100 + i)).collect();
        let vs: Vec<Tensor> = (0..13).map(|i| randn(&[1, nkv, 1, d], 200 + i)).collect();
        for p in 0..13 {
            sl.append(&ks[p], &vs[p]).unwrap();
            let q = randn(&[1, hq, 1, d], 300 + p as u64);
            let got = sl.attend(&q, 0.2).unwrap();
            let mut full = Fp16Cache::new(nkv, d);
            for j in p.saturating_sub(w - 1)..=p {
                full.append(&ks[j], &vs[j]).unwrap();
            }
            let want = full.attend(&q, 0.2).unwrap();
            let err = (got - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(err < 1e-5, "position {p}: {err}");
            assert_eq!(sl.len(), p + 1);
            assert!(sl.rows() <= w);
        }
        // A prefill of 9 positions at once: row i sees i − w + 1..=i.
        let k = Tensor::cat(&ks[..9], 2).unwrap();
        let v = Tensor::cat(&vs[..9], 2).unwrap();
        let q = randn(&[1, hq, 9, d], 7);
        let mut sl = SlidingCache::new(nkv, d, w).unwrap();
        sl.append(&k, &v).unwrap();
        let got = sl.attend(&q, 0.2).unwrap();
        for i in [0usize, 3, 8] {
            let mut full = Fp16Cache::new(nkv, d);
            for j in i.saturating_sub(w - 1)..=i {
                full.append(&ks[j], &vs[j]).unwrap();
            }
            let want = full.attend(&q.narrow(2, i, 1).unwrap(), 0.2).unwrap();
            let err = (got.narrow(2, i, 1).unwrap() - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(err < 1e-5, "prefill row {i}: {err}");
        }
    }

    #[test]
    fn truncating_past_evicted_positions_is_an_error() {
        let mut sl = SlidingCache::new(1, 8, 3).unwrap();
        for i in 0..10 {
            sl.append(&randn(&[1, 1, 1, 8], i), &randn(&[1, 1, 1, 8], 50 + i)).unwrap();
        }
        assert!(sl.truncate(2).is_err());
        assert_eq!(sl.len(), 10);
        sl.truncate(0).unwrap();
        assert_eq!(sl.len(), 0);
    }
}
