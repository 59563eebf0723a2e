//! What the harnesses run a method with: the product's [`CacheConfig`], or a lab candidate that no
//! kernel carries yet ([`Simulation`](crate::simulate::Simulation)). Perplexity, KL and the needle
//! grid take either, so a candidate is scored by the same code as the methods it would join.

use veloq::calibrate::TextFingerprint;
use veloq_candle::cache::ModelCache;
use veloq_candle::config::CacheConfig;
use veloq_candle::error::Result;
use veloq_candle::model::Model;
use veloq_candle::Method;

/// A way to build a method's caches.
pub trait CacheSource: Sync {
    /// One cache per layer for `slots` sequences of up to `capacity` positions (`None`: the
    /// source's own default).
    fn build(&self, model: &Model, slots: usize, capacity: Option<usize>) -> Result<ModelCache>;
    /// Stored bits per element of a `tokens`-position sequence, metadata included.
    fn code_bits(&self, model: &Model, tokens: usize) -> Result<f64>;
    /// Bits per element of the coded stream (what the rate converges to at long context).
    fn stream_bits(&self, model: &Model) -> Result<f64>;
    /// The calibration text, which evaluation must not score on.
    fn calibration_text(&self) -> Option<&TextFingerprint>;
    /// Whether it is the fp16 reference.
    fn is_reference(&self) -> bool;
}

impl CacheSource for CacheConfig {
    fn build(&self, model: &Model, slots: usize, capacity: Option<usize>) -> Result<ModelCache> {
        CacheConfig { capacity: capacity.or(self.capacity), ..self.clone() }.build_batch(model, slots)
    }
    fn code_bits(&self, model: &Model, tokens: usize) -> Result<f64> {
        self.code_bits_per_element(model, tokens)
    }
    fn stream_bits(&self, model: &Model) -> Result<f64> {
        self.stream_bits_per_element(model)
    }
    fn calibration_text(&self) -> Option<&TextFingerprint> {
        self.calibration.as_ref().map(|c| &c.text)
    }
    fn is_reference(&self) -> bool {
        matches!(self.method, Method::Fp16)
    }
}

/// Labelled configurations as the harnesses take them.
pub fn sources(methods: &[(String, CacheConfig)]) -> Vec<(String, &dyn CacheSource)> {
    methods.iter().map(|(l, c)| (l.clone(), c as &dyn CacheSource)).collect()
}
