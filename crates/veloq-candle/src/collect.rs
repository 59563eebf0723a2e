//! Calibration on the model's own activations: run real text through the model with caches that
//! record every layer's post-RoPE keys and values, then train each layer's codecs.

use std::sync::{Arc, Mutex};

use candle_core::Tensor;

use veloq::artifact::{Calibration, LayerCodecs};
use veloq::calibrate::{train_codec_with_progress, KMeansConfig, TextFingerprint};
use veloq::codec::vecinfer::CodecSpec;

use crate::cache::{LayerCache, ModelCache, Step};
use crate::config::CacheConfig;
use crate::error::{Error, Result};
use crate::model::Model;

/// Every layer's activations over some text, and that text's fingerprint (which the calibration
/// carries, so evaluation can refuse to score on it).
pub struct Activations {
    pub layers: Vec<LayerActivations>,
    pub text: TextFingerprint,
}

/// Keys and values of one layer, token-major `[tokens, n_kv_heads, head_dim]`.
#[derive(Default)]
pub struct LayerActivations {
    pub keys: Vec<f32>,
    pub values: Vec<f32>,
}

/// An fp16 cache that also copies everything appended to it into a shared sink.
struct Recorder {
    inner: Box<dyn LayerCache>,
    sink: Arc<Mutex<LayerActivations>>,
}

impl LayerCache for Recorder {
    fn append(&mut self, k: &Tensor, v: &Tensor, step: &Step) -> Result<()> {
        let rows = |x: &Tensor| -> Result<Vec<f32>> {
            Ok(x.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
        };
        let (kr, vr) = (rows(k)?, rows(v)?);
        let mut s = self.sink.lock().expect("recorder lock");
        s.keys.extend(kr);
        s.values.extend(vr);
        drop(s);
        self.inner.append(k, v, step)
    }
    fn attend(&self, q: &Tensor, step: &Step, scale: f32) -> Result<Tensor> {
        self.inner.attend(q, step, scale)
    }
    fn commit(&mut self) -> Result<()> {
        self.inner.commit()
    }
    fn slots(&self) -> usize {
        self.inner.slots()
    }
    fn len(&self, slot: usize) -> usize {
        self.inner.len(slot)
    }
    fn resident_bytes(&self) -> usize {
        self.inner.resident_bytes()
    }
    fn truncate(&mut self, slot: usize, len: usize) -> Result<()> {
        self.inner.truncate(slot, len)
    }
}

/// Runs `tokens` through the model in windows of `window` positions (fresh caches per window) and
/// returns every layer's keys and values, token-major `[tokens, kv heads, head_dim]`.
/// `progress(done_tokens)` after each window.
pub fn collect_activations(
    model: &Model,
    tokens: &[u32],
    window: usize,
    progress: &mut dyn FnMut(usize),
) -> Result<Activations> {
    let sinks: Vec<_> =
        (0..model.info.identity.n_layers).map(|_| Arc::new(Mutex::new(LayerActivations::default()))).collect();
    let mut done = 0;
    for chunk in tokens.chunks(window.max(1)) {
        let fp16 = CacheConfig { capacity: Some(chunk.len()), ..CacheConfig::fp16() }.build(model)?;
        let layers = fp16
            .into_layers()
            .into_iter()
            .zip(&sinks)
            .map(|(inner, s)| Box::new(Recorder { inner, sink: s.clone() }) as Box<dyn LayerCache>)
            .collect();
        let mut caches = ModelCache::new(layers)?;
        model.forward(chunk, &mut caches, false)?;
        done += chunk.len();
        progress(done);
    }
    let layers = sinks
        .into_iter()
        .map(|s| {
            Arc::try_unwrap(s)
                .map_err(|_| Error::Config("recorder still shared".into()))
                .map(|m| m.into_inner().expect("recorder lock"))
        })
        .collect::<Result<_>>()?;
    Ok(Activations { layers, text: TextFingerprint::of_tokens(tokens) })
}

/// Trains key and value codecs for every layer from collected activations.
pub fn calibrate(
    model: &Model,
    acts: &Activations,
    keys: CodecSpec,
    values: CodecSpec,
    seed: u64,
    progress: &mut dyn FnMut(usize),
) -> Result<Calibration> {
    let id = &model.info.identity;
    let tokens = acts.layers.first().map_or(0, |a| a.keys.len() / (id.n_kv_heads * id.head_dim));
    let mut layers = Vec::with_capacity(acts.layers.len());
    for (i, a) in acts.layers.iter().enumerate() {
        let kcfg = KMeansConfig::new(keys.shape.centroids(), seed.wrapping_add(1000 * i as u64));
        let vcfg = KMeansConfig::new(values.shape.centroids(), seed.wrapping_add(1000 * i as u64 + 500));
        let (k, _) = train_codec_with_progress(&a.keys, id.n_kv_heads, id.head_dim, &keys, &kcfg, &|_, _, _| {})?;
        let (v, _) = train_codec_with_progress(&a.values, id.n_kv_heads, id.head_dim, &values, &vcfg, &|_, _, _| {})?;
        layers.push(LayerCodecs { keys: k, values: v });
        progress(i + 1);
    }
    Ok(Calibration::new(id.clone(), keys, values, seed, tokens, layers)?.with_text(acts.text.clone()))
}
