//! Caches for a loaded model: a [`Method`] with its calibration, window and kernel switch, built
//! into one cache per layer on the model's device.
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

use candle_core::Device;

use veloq::artifact::{Calibration, ModelIdentity};
use veloq::codec::block::BlockCodec;
use veloq::codec::kivi::{KiviAxis, KiviCodec};
use veloq::codec::lloyd_max::LloydMaxCodec;
use veloq::kernels::select::KernelChoice;

use crate::cache::{Backend, CpuBackend, Heads, KvCache, LayerCache, ModelCache, Policy, TensorBackend};
use crate::error::{Error, Result};
use crate::method::Method;
use crate::model::Model;

/// The f16 rows a coded cache keeps beside its codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowConfig {
    /// Recent positions kept in f16 after a flush.
    pub window: usize,
    /// Positions encoded per flush (a multiple of 8 and of the codecs' block size).
    pub flush_block: usize,
    /// First positions kept in f16 for good (attention sinks: the model parks attention on the
    /// first tokens, and their keys are outliers no codebook fits).
    pub sink: usize,
}

impl Default for WindowConfig {
    /// 16–23 recent positions exact, codes written 8 positions at a time, 4 sink positions: the
    /// window's storage (24 positions) stays small next to the codes at 1k tokens.
    fn default() -> Self {
        Self { window: 16, flush_block: 8, sink: 4 }
    }
}

impl std::str::FromStr for WindowConfig {
    type Err = Error;

    /// `SINK/RECENT`: first positions kept for good and recent positions kept after a flush (the
    /// default flush block).
    fn from_str(s: &str) -> Result<Self> {
        let bad = || Error::Config(format!("{s:?}: f16 rows are SINK/RECENT positions, e.g. 64/256"));
        let (sink, recent) = s.trim().split_once('/').ok_or_else(bad)?;
        let (sink, window) = (sink.parse().map_err(|_| bad())?, recent.parse().map_err(|_| bad())?);
        Ok(Self { sink, window, ..Self::default() })
    }
}

impl std::fmt::Display for WindowConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.sink, self.window)
    }
}

/// A method with what building its caches takes: the calibration of a VecInfer method, the f16
/// window beside the codes, the kernel switch and the positions a device reserves per sequence.
#[derive(Clone, Debug)]
pub struct CacheConfig {
    /// What the caches store.
    pub method: Method,
    /// The codebooks of a VecInfer method (`None` for the others).
    pub calibration: Option<Arc<Calibration>>,
    /// The f16 window of recent positions and the flush block (rounded up per method to a
    /// multiple of the codec's block, e.g. KIVI's key group).
    pub window: WindowConfig,
    /// Fused kernels (the CPU lookup-table path on CPU devices) or the portable candle-ops path.
    pub kernels: KernelChoice,
    /// Positions per sequence that device caches reserve up front; default the model's
    /// `max_context`.
    pub capacity: Option<usize>,
}

/// One layer's key and value codecs, as the caches see them.
type LayerPair = (Arc<dyn BlockCodec>, Arc<dyn BlockCodec>);

impl CacheConfig {
    /// The caches of `method`, with the calibration a VecInfer method needs (trained for the same
    /// specs: shapes, centering, smoothing, rotation, granularity); the default window (no sinks
    /// for `/no-sink` methods) and kernels.
    pub fn new(method: Method, calibration: Option<Calibration>) -> Result<Self> {
        let window = match method {
            Method::VecInfer(v) if !v.sink => WindowConfig { sink: 0, ..WindowConfig::default() },
            _ => WindowConfig::default(),
        };
        match (&method, &calibration) {
            (Method::VecInfer(v), Some(cal)) if (cal.keys, cal.values) != (v.keys, v.values) => {
                return Err(Error::CalibrationMismatch(format!(
                    "the calibration was trained for {}, the method is {method}",
                    Method::of_calibration(cal)
                )))
            }
            (Method::VecInfer(_), None) => {
                return Err(Error::CalibrationMismatch(format!(
                    "{method} needs a calibration (veloq calibrate --method {method})"
                )))
            }
            (m, Some(_)) if !m.needs_calibration() => {
                return Err(Error::CalibrationMismatch(format!("{m} takes no calibration")))
            }
            _ => {}
        }
        Ok(Self { method, calibration: calibration.map(Arc::new), window, kernels: KernelChoice::Auto, capacity: None })
    }

    /// Uncompressed f16 caches.
    pub fn fp16() -> Self {
        Self::new(Method::Fp16, None).expect("fp16 takes no calibration")
    }

    /// VecInfer caches with `calibration`'s codebooks (the method it was trained for).
    pub fn vecinfer(calibration: Calibration) -> Self {
        Self::new(Method::of_calibration(&calibration), Some(calibration)).expect("a calibration's own method")
    }

    /// Loads a calibration artifact, checks it was made for `model`, and takes its method.
    pub fn vecinfer_from_file(path: &Path, model: &Model) -> Result<Self> {
        Ok(Self::vecinfer(Calibration::load_for(path, &model.info.identity)?))
    }

    /// KIVI caches of `bits`-bit codes in groups of `group`.
    pub fn kivi(bits: u32, group: usize) -> Self {
        Self::new(Method::Kivi { bits, group }, None).expect("KIVI takes no calibration")
    }

    /// Rotation + Lloyd–Max caches of `bits`-bit levels.
    pub fn rot_lloyd_max(bits: u32) -> Self {
        Self::new(Method::RotLloydMax { bits }, None).expect("Lloyd–Max takes no calibration")
    }

    /// The method's name (`vq-4`, `fp16`, `kivi-2`…).
    pub fn name(&self) -> String {
        self.method.to_string()
    }

    /// Each layer's codecs (`None` for fp16).
    fn codecs(&self, g: &Geometry) -> Result<Option<Vec<LayerPair>>> {
        let id = &g.identity;
        let (h, d) = (id.n_kv_heads, id.head_dim);
        let layers = 0..id.n_layers;
        Ok(Some(match (&self.method, &self.calibration) {
            (Method::Fp16, _) => return Ok(None),
            (Method::VecInfer(_), None) => {
                return Err(Error::CalibrationMismatch("VecInfer without a calibration".into()))
            }
            (Method::VecInfer(_), Some(cal)) => {
                check_calibration(cal, id)?;
                cal.layers
                    .iter()
                    .map(|l| (Arc::new(l.keys.clone()) as Arc<dyn BlockCodec>, Arc::new(l.values.clone()) as _))
                    .collect()
            }
            (&Method::Kivi { bits, group }, _) => {
                let k: Arc<dyn BlockCodec> = Arc::new(KiviCodec::new(h, d, bits, group, KiviAxis::PerChannel)?);
                let v: Arc<dyn BlockCodec> = Arc::new(KiviCodec::new(h, d, bits, group, KiviAxis::PerToken)?);
                layers.map(|_| (k.clone(), v.clone())).collect()
            }
            (&Method::RotLloydMax { bits }, _) => layers
                .map(|i| {
                    let k = LloydMaxCodec::new(h, d, bits, 2 * i as u64)?;
                    let v = LloydMaxCodec::new(h, d, bits, 2 * i as u64 + 1)?;
                    Ok((Arc::new(k) as Arc<dyn BlockCodec>, Arc::new(v) as _))
                })
                .collect::<Result<_>>()?,
        }))
    }

    /// Stored bits per cached element once `tokens` positions are coded, all metadata counted
    /// (group scales, codebooks and smoothing scales amortised over the tokens); 16 for fp16.
    pub fn code_bits_per_element(&self, model: &Model, tokens: usize) -> Result<f64> {
        Ok(match self.codecs(&Geometry::of(model))? {
            None => 16.0,
            Some(pairs) => {
                let sum: f64 = pairs.iter().map(|(k, v)| k.bits_per_element(tokens) + v.bits_per_element(tokens)).sum();
                sum / (2 * pairs.len()) as f64
            }
        })
    }

    /// Bits per element of the coded stream alone: codes plus per-token/per-group scales, without
    /// the tables shared by all positions (codebooks, means, smoothing scales). The rate a long
    /// context converges to; 16 for fp16.
    pub fn stream_bits_per_element(&self, model: &Model) -> Result<f64> {
        let id = &model.info.identity;
        let n = 1024;
        Ok(match self.codecs(&Geometry::of(model))? {
            None => 16.0,
            Some(pairs) => {
                let bytes: usize = pairs.iter().map(|(k, v)| k.encoded_len(n) + v.encoded_len(n)).sum();
                (bytes * 8) as f64 / (2 * pairs.len() * n * id.n_kv_heads * id.head_dim) as f64
            }
        })
    }

    /// One cache per layer of `model`, for one sequence. Sliding-window layers hold at most their
    /// window, in f16, whatever the method; the method codes the others.
    pub fn build(&self, model: &Model) -> Result<ModelCache> {
        self.build_batch(model, 1)
    }

    /// One cache per layer for `slots` sequences, each up to `capacity` positions (default the
    /// model's `max_context`). Devices with fused kernels get them (the CPU kernels on the CPU,
    /// veloq's CUDA kernels with the `cuda` feature), others the portable candle-ops backend, as
    /// [`kernels`](Self::kernels) says; the scalar baselines have fused kernels on the CPU only
    /// (elsewhere their codes live and attend on the device in tensor ops).
    pub fn build_batch(&self, model: &Model, slots: usize) -> Result<ModelCache> {
        self.build_for(&Geometry::of(model), model.device(), slots)
    }

    /// [`build_batch`](Self::build_batch) for a model described by its geometry alone (one veloq
    /// does not run: a transformers model through the Python binding), on `dev`.
    pub fn build_for(&self, g: &Geometry, dev: &Device, slots: usize) -> Result<ModelCache> {
        let id = &g.identity;
        let heads = Heads { q: g.q_heads, kv: id.n_kv_heads, dim: id.head_dim };
        if g.windows.len() != id.n_layers {
            return Err(Error::Shape(format!("{} layer windows for {} layers", g.windows.len(), id.n_layers)));
        }
        let capacity = self.capacity.unwrap_or(g.max_context);
        let dense_fused = self.kernels.resolve(dense_kernels(dev))?;
        let vecinfer_fused = match &self.calibration {
            Some(cal) => {
                check_calibration(cal, id)?;
                Some(self.kernels.resolve(fused_available(dev, cal, heads.q))?)
            }
            _ => None,
        };
        // The scalar baselines' codecs (VecInfer's come from the calibration, layer by layer):
        // the CPU's kernels on the CPU, tensor ops on the device elsewhere.
        let baselines = if vecinfer_fused.is_none() { self.codecs(g)? } else { None };
        let scalar_fused = match &baselines {
            Some(_) => self.kernels.resolve(scalar_kernels(dev))?,
            None => false,
        };
        #[cfg(feature = "cuda")]
        let runtime = match (dev, dense_fused || vecinfer_fused == Some(true)) {
            (Device::Cuda(_), true) => Some(crate::cache::CudaRuntime::new(dev)?),
            _ => None,
        };
        fn layer<B: Backend + 'static>(
            policy: Policy,
            slots: usize,
            heads: Heads,
            b: B,
        ) -> Result<Box<dyn LayerCache>> {
            Ok(Box::new(KvCache::new(policy, slots, heads, b)?))
        }
        let dense = |policy: Policy| -> Result<Box<dyn LayerCache>> {
            let rows = policy.rows();
            #[cfg(feature = "cuda")]
            if let (Some(rt), true) = (&runtime, dense_fused) {
                return layer(
                    policy,
                    slots,
                    heads,
                    crate::cache::CudaBackend::dense(rt.clone(), heads, slots, rows, dev)?,
                );
            }
            match (dev, dense_fused) {
                (Device::Cpu, true) => layer(policy, slots, heads, CpuBackend::dense(heads, slots, rows)),
                _ => layer(policy, slots, heads, TensorBackend::dense(heads, slots, rows, dev)?),
            }
        };
        let w = self.window;
        let mut layers: Vec<Box<dyn LayerCache>> = Vec::with_capacity(id.n_layers);
        for i in 0..id.n_layers {
            if let Some(window) = g.windows[i] {
                layers.push(dense(Policy::sliding(window, capacity))?);
                continue;
            }
            layers.push(match (&self.method, &self.calibration, &baselines) {
                (Method::Fp16, _, _) => dense(Policy::dense(capacity))?,
                (Method::VecInfer(_), Some(cal), _) => {
                    let l = &cal.layers[i];
                    let block = lcm(lcm(w.flush_block, l.keys.block_tokens()), l.values.block_tokens());
                    let policy = Policy::coded(w.sink, w.window, block, capacity);
                    let rows = policy.rows();
                    let fused = vecinfer_fused == Some(true);
                    #[cfg(feature = "cuda")]
                    if let (Some(rt), true) = (&runtime, fused) {
                        let b = crate::cache::CudaBackend::vecinfer(
                            rt.clone(),
                            heads,
                            slots,
                            rows,
                            capacity,
                            &l.keys,
                            &l.values,
                            dev,
                        )?;
                        layers.push(layer(policy, slots, heads, b)?);
                        continue;
                    }
                    match (dev, fused) {
                        (Device::Cpu, true) => {
                            let (k, v) = (Arc::new(l.keys.clone()), Arc::new(l.values.clone()));
                            layer(policy, slots, heads, CpuBackend::vecinfer(heads, slots, rows, k, v, block)?)?
                        }
                        _ => layer(
                            policy,
                            slots,
                            heads,
                            TensorBackend::vecinfer(heads, slots, rows, capacity, &l.keys, &l.values, dev)?,
                        )?,
                    }
                }
                (_, _, Some(pairs)) => {
                    let (k, v) = pairs[i].clone();
                    let block = lcm(lcm(w.flush_block, k.block_tokens()), v.block_tokens());
                    let policy = Policy::coded(w.sink, w.window, block, capacity);
                    let rows = policy.rows();
                    if scalar_fused {
                        layer(policy, slots, heads, CpuBackend::decoding(heads, slots, rows, k, v, block)?)?
                    } else {
                        layer(
                            policy,
                            slots,
                            heads,
                            TensorBackend::scalar(heads, slots, rows, capacity, &*k, &*v, dev)?,
                        )?
                    }
                }
                _ => return Err(Error::CalibrationMismatch(format!("{} has no codecs", self.name()))),
            });
        }
        ModelCache::new(layers)
    }
}

/// What caches are built for: the model's identity (which calibrations fit it), its query heads,
/// the layers that slide over a window, and the longest context. A [`Model`] has one; a model veloq
/// does not run (transformers', through the Python binding) states its own.
#[derive(Clone, Debug, PartialEq)]
pub struct Geometry {
    /// Name, architecture, layers, kv heads, head dim.
    pub identity: ModelIdentity,
    /// Query heads (a multiple of the kv heads).
    pub q_heads: usize,
    /// Per layer, the sliding window it attends over (`None`: global attention).
    pub windows: Vec<Option<usize>>,
    /// Positions a sequence may reach unless [`CacheConfig::capacity`] says fewer.
    pub max_context: usize,
}

impl Geometry {
    /// `model`'s.
    pub fn of(model: &Model) -> Self {
        let id = &model.info.identity;
        Self {
            identity: id.clone(),
            q_heads: model.info.n_heads,
            windows: (0..id.n_layers).map(|i| model.layer_window(i)).collect(),
            max_context: model.max_context(),
        }
    }
}

/// Whether fused kernels serve the scalar baselines (KIVI, rotation + Lloyd–Max) on `dev`.
fn scalar_kernels(dev: &Device) -> std::result::Result<(), String> {
    match dev {
        Device::Cpu => Ok(()),
        other => Err(format!("no fused KIVI or Lloyd–Max kernels for {other:?} (the portable tensor ops serve them)")),
    }
}

/// Whether fused kernels serve fp16 (dense) caches on `dev`: the CPU kernels always, the CUDA
/// ones with the `cuda` feature.
fn dense_kernels(dev: &Device) -> std::result::Result<(), String> {
    match dev {
        Device::Cpu => Ok(()),
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => Ok(()),
        other => Err(format!("no fused kernels for {other:?} in this build (the CUDA ones need the `cuda` feature)")),
    }
}

/// Whether fused VecInfer kernels serve caches on `dev`: the CPU lookup-table path always; the
/// CUDA kernels when built with the `cuda` feature and the codecs fit them.
fn fused_available(dev: &Device, cal: &Calibration, q_heads: usize) -> std::result::Result<(), String> {
    match dev {
        Device::Cpu => Ok(()),
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => match cal.layers.first() {
            Some(l) => veloq::kernels::cuda::GpuAttention::supports(&l.keys, &l.values, q_heads),
            None => Err("the calibration has no layers".into()),
        },
        other => {
            let _ = (cal, q_heads);
            Err(format!(
                "no fused VecInfer kernels for {other:?} in this build (the CUDA ones need the `cuda` feature)"
            ))
        }
    }
}

fn check_calibration(cal: &Calibration, id: &ModelIdentity) -> Result<()> {
    let m = &cal.model;
    if m.architecture != id.architecture
        || m.n_layers != id.n_layers
        || m.n_kv_heads != id.n_kv_heads
        || m.head_dim != id.head_dim
    {
        return Err(Error::CalibrationMismatch(format!(
            "calibration is for {} ({} layers, {} kv-heads, head_dim {}), the model is {} ({} layers, {} kv-heads, head_dim {})",
            m.name, m.n_layers, m.n_kv_heads, m.head_dim, id.name, id.n_layers, id.n_kv_heads, id.head_dim
        )));
    }
    Ok(())
}

fn lcm(a: usize, b: usize) -> usize {
    let gcd = |mut a: usize, mut b: usize| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    a / gcd(a, b) * b
}

/// What an f16 cache of `tokens` positions would hold for `model` (keys + values, no padding;
/// sliding-window layers hold their window).
pub fn fp16_bytes(model: &Model, tokens: usize) -> usize {
    let id = &model.info.identity;
    let positions: usize = (0..id.n_layers).map(|i| model.layer_window(i).map_or(tokens, |w| w.min(tokens))).sum();
    positions * id.n_kv_heads * id.head_dim * 2 * 2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_rows_parse_and_print() {
        let w: WindowConfig = "64/256".parse().unwrap();
        assert_eq!(w, WindowConfig { sink: 64, window: 256, flush_block: WindowConfig::default().flush_block });
        assert_eq!(w.to_string().parse::<WindowConfig>().unwrap(), w);
        for bad in ["64", "64/", "/256", "a/b", "-1/16"] {
            let e = bad.parse::<WindowConfig>().unwrap_err().to_string();
            assert!(e.contains("SINK/RECENT"), "{bad}: {e}");
        }
    }
}
