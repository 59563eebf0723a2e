//! A [`LayerCache`] that holds what the storage policy says a coded cache holds ([`Shadow`]) and
//! attends over it in f64: the exact reference for a model run through a coded cache, whatever
//! the codec's quality on the machine's calibration.

use std::sync::Arc;

use candle_core::{Device, Tensor};

use veloq::codec::block::BlockCodec;
use veloq_candle::cache::{LayerCache, Step};
use veloq_candle::Result;

use super::shadow::{Shadow, Window};

/// One layer's reference cache.
pub struct ShadowCache {
    shadow: Shadow,
    /// kv heads and head_dim.
    kv: usize,
    dim: usize,
    /// Slots the last appended step touched (committed next).
    last: Vec<usize>,
}

impl ShadowCache {
    /// A cache of `slots` sequences coding with `codecs` (`None`: dense f16) under `window`.
    pub fn new(
        slots: usize,
        kv: usize,
        dim: usize,
        window: Window,
        codecs: Option<(Arc<dyn BlockCodec>, Arc<dyn BlockCodec>)>,
    ) -> Self {
        Self { shadow: Shadow::new(slots, window, None, codecs), kv, dim, last: Vec::new() }
    }
}

fn host(x: &Tensor) -> Vec<f32> {
    x.to_dtype(candle_core::DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

impl LayerCache for ShadowCache {
    fn append(&mut self, k: &Tensor, v: &Tensor, step: &Step) -> Result<()> {
        let (k, v, row) = (host(k), host(v), self.kv * self.dim);
        for (i, s) in step.seqs().iter().enumerate() {
            assert_eq!(self.shadow.keys[s.slot].len(), s.start, "a step must continue its sequence");
            let r = step.rows(i);
            self.shadow.push(s.slot, &k[r.start * row..r.end * row], &v[r.start * row..r.end * row], row);
        }
        self.last = step.seqs().iter().map(|s| s.slot).collect();
        Ok(())
    }

    fn attend(&self, q: &Tensor, step: &Step, scale: f32) -> Result<Tensor> {
        let (tokens, hq, d) = q.dims3()?;
        let q = host(q);
        let mut out = Vec::with_capacity(q.len());
        for (i, s) in step.seqs().iter().enumerate() {
            let r = step.rows(i);
            let part = self.shadow.attend(
                s.slot,
                s.start,
                &q[r.start * hq * d..r.end * hq * d],
                (hq, self.kv, d),
                scale as f64,
            );
            out.extend(part.into_iter().map(|x| x as f32));
        }
        Ok(Tensor::from_vec(out, (tokens, hq, d), &Device::Cpu)?)
    }

    fn commit(&mut self) -> Result<()> {
        for slot in std::mem::take(&mut self.last) {
            self.shadow.commit(slot);
        }
        Ok(())
    }

    fn slots(&self) -> usize {
        self.shadow.keys.len()
    }

    fn len(&self, slot: usize) -> usize {
        self.shadow.keys[slot].len()
    }

    fn truncate(&mut self, slot: usize, len: usize) -> Result<()> {
        self.shadow.truncate(slot, len);
        Ok(())
    }

    fn resident_bytes(&self) -> usize {
        0
    }

    fn sequence_bytes(&self, _: usize) -> usize {
        0
    }
}
