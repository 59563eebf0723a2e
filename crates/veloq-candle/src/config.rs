//! The library's front door: pick a method, build one cache per layer for a loaded model.
//!
//! ```no_run
//! # use veloq_candle::{config::CacheConfig, model::Model, generate::{generate, GenerateOptions}};
//! # fn main() -> veloq_candle::Result<()> {
//! let (model, tokenizer) = Model::open("smollm2.gguf".as_ref(), 4096)?;
//! let mut caches = CacheConfig::vecinfer_from_file("smollm2.vecinfer.safetensors".as_ref(), &model)?.build(&model)?;
//! let out = generate(&model, &tokenizer, &mut caches, "Why is the sky blue?", &GenerateOptions::default(), &mut |s| print!("{s}"))?;
//! # Ok(()) }
//! ```

use std::path::Path;
use std::sync::Arc;

use veloq::artifact::Calibration;

use crate::cache::{Fp16Cache, LayerCache, VecInferCache, VecInferCacheConfig};
use crate::error::{Error, Result};
use crate::model::Model;

#[derive(Clone, Debug)]
pub enum Method {
    /// Uncompressed f16 keys and values (the reference).
    Fp16,
    /// VecInfer codes with a calibration for this model.
    VecInfer(Arc<Calibration>),
}

#[derive(Clone, Debug)]
pub struct CacheConfig {
    pub method: Method,
    pub vecinfer: VecInferCacheConfig,
}

impl CacheConfig {
    pub fn fp16() -> Self {
        Self { method: Method::Fp16, vecinfer: VecInferCacheConfig::default() }
    }

    pub fn vecinfer(calibration: Calibration) -> Self {
        Self { method: Method::VecInfer(Arc::new(calibration)), vecinfer: VecInferCacheConfig::default() }
    }

    /// Loads a calibration artifact and checks it was made for `model`.
    pub fn vecinfer_from_file(path: &Path, model: &Model) -> Result<Self> {
        Ok(Self::vecinfer(Calibration::load_for(path, &model.info.identity)?))
    }

    pub fn name(&self) -> String {
        match &self.method {
            Method::Fp16 => "fp16".into(),
            Method::VecInfer(c) => format!(
                "vecinfer-k{}b{}-v{}b{}",
                c.keys.shape.sub_dim, c.keys.shape.bits, c.values.shape.sub_dim, c.values.shape.bits
            ),
        }
    }

    /// One cache per layer of `model`.
    pub fn build(&self, model: &Model) -> Result<Vec<Box<dyn LayerCache>>> {
        let id = &model.info.identity;
        match &self.method {
            Method::Fp16 => Ok((0..id.n_layers).map(|_| Box::new(Fp16Cache::new(id.n_kv_heads, id.head_dim)) as Box<dyn LayerCache>).collect()),
            Method::VecInfer(cal) => {
                let m = &cal.model;
                if m.architecture != id.architecture || m.n_layers != id.n_layers || m.n_kv_heads != id.n_kv_heads || m.head_dim != id.head_dim {
                    return Err(Error::Config(format!(
                        "calibration is for {} ({} layers, {} kv-heads, head_dim {}), the model is {} ({} layers, {} kv-heads, head_dim {})",
                        m.name, m.n_layers, m.n_kv_heads, m.head_dim, id.name, id.n_layers, id.n_kv_heads, id.head_dim
                    )));
                }
                cal.layers
                    .iter()
                    .map(|l| {
                        let c = VecInferCache::new(Arc::new(l.keys.clone()), Arc::new(l.values.clone()), self.vecinfer)?;
                        Ok(Box::new(c) as Box<dyn LayerCache>)
                    })
                    .collect()
            }
        }
    }
}

/// Resident bytes of all layers' caches.
pub fn resident_bytes(caches: &[Box<dyn LayerCache>]) -> usize {
    caches.iter().map(|c| c.resident_bytes()).sum()
}

/// What an f16 cache of `tokens` positions would hold for `model` (keys + values, no padding).
pub fn fp16_bytes(model: &Model, tokens: usize) -> usize {
    let id = &model.info.identity;
    tokens * id.n_layers * id.n_kv_heads * id.head_dim * 2 * 2
}
