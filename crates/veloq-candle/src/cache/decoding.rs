//! The cache for the scalar baselines (KIVI, rotation + Lloyd–Max): codes stored for real through
//! [`CodedStore`], attention over rows decoded for the call. These methods exist to be measured
//! against VecInfer on quality; their attention is the plain reference, not a fused kernel.

use std::sync::Arc;

use candle_core::Tensor;

use veloq::codec::block::BlockCodec;

use super::store::{CodedStore, WindowConfig};
use super::{token_major, LayerCache};
use crate::error::Result;

pub struct DecodingCache {
    store: CodedStore,
}

impl DecodingCache {
    pub fn new(keys: Arc<dyn BlockCodec>, values: Arc<dyn BlockCodec>, cfg: WindowConfig) -> Result<Self> {
        Ok(Self { store: CodedStore::new(keys, values, cfg)? })
    }
}

impl LayerCache for DecodingCache {
    fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        let (h, _, d, kr) = token_major(k)?;
        let (_, _, _, vr) = token_major(v)?;
        self.store.push(h, d, &kr, &vr)
    }

    fn attend(&mut self, q: &Tensor, scale: f64) -> Result<Tensor> {
        let y = self.store.attend_decoded(q, scale)?;
        self.store.flush()?;
        Ok(y)
    }

    fn len(&self) -> usize {
        self.store.len()
    }
    fn resident_bytes(&self) -> usize {
        self.store.resident_bytes()
    }
    fn truncate(&mut self, len: usize) -> Result<()> {
        self.store.truncate(len)
    }
    fn commit(&mut self) -> Result<()> {
        self.store.flush()
    }
}
