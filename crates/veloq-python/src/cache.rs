//! The codec and the cache over NumPy arrays: `Calibration` (load, quantize, dequantize one
//! layer's keys or values) and `KvCache` — veloq's cache for a model veloq does not run (the
//! transformers integration's layers), appending keys and values and attending over codes with
//! the same kernels the runner uses.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::{Device as CandleDevice, Tensor};
use numpy::{IntoPyArray, PyArray1, PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::prelude::*;

use veloq::artifact::{Calibration as RustCalibration, ModelIdentity};
use veloq::calibrate::TextFingerprint;
use veloq::codec::vecinfer::VecInferCodec;
use veloq_candle::cache::{ModelCache, Step};
use veloq_candle::collect::{calibrate_for, Activations, LayerActivations};
use veloq_candle::config::Geometry;
use veloq_candle::{CacheConfig, Method};

use crate::errors::{ConfigError, IntoPy, ShapeError};
use crate::model::parse_method;

/// A VecInfer calibration: every layer's key and value codecs.
#[pyclass(module = "veloq", frozen)]
pub struct Calibration {
    pub(crate) inner: Arc<RustCalibration>,
}

/// A float32 array's data, C order, checked against `shape` (`None` matches any length).
fn rows<'a>(x: &'a PyReadonlyArrayDyn<'_, f32>, shape: &[Option<usize>], what: &str) -> PyResult<&'a [f32]> {
    let dims = x.shape();
    if dims.len() != shape.len() || dims.iter().zip(shape).any(|(d, s)| s.is_some_and(|s| s != *d)) {
        let want: Vec<String> = shape.iter().map(|s| s.map_or("n".into(), |s| s.to_string())).collect();
        return Err(ShapeError::new_err(format!("{what}: expected shape [{}], got {dims:?}", want.join(", "))));
    }
    x.as_slice()
        .map_err(|_| ShapeError::new_err(format!("{what}: the array must be C-contiguous (np.ascontiguousarray)")))
}

impl Calibration {
    fn codec(&self, layer: usize, side: &str) -> PyResult<&VecInferCodec> {
        let l = self.inner.layers.get(layer).ok_or_else(|| {
            ConfigError::new_err(format!("layer {layer}: the calibration has {} layers", self.inner.layers.len()))
        })?;
        match side {
            "keys" | "k" => Ok(&l.keys),
            "values" | "v" => Ok(&l.values),
            _ => Err(ConfigError::new_err(format!("side {side:?}: expected \"keys\" or \"values\""))),
        }
    }
}

#[pymethods]
impl Calibration {
    /// Reads a calibration artifact (`veloq calibrate`'s safetensors file).
    #[staticmethod]
    fn load(path: PathBuf) -> PyResult<Self> {
        Ok(Self { inner: Arc::new(RustCalibration::load(&path).py()?) })
    }

    /// Trains the codecs of VecInfer `method` from a model's own activations: `keys` and
    /// `values`, one `[tokens, kv_heads, head_dim]` float32 array per layer (post-RoPE keys), for
    /// a model named `name` of `architecture`. `token_ids` (the text's tokens) go into the
    /// artifact's fingerprint, so evaluation can refuse to score on calibration text.
    /// `progress(done, total)` after each layer.
    #[staticmethod]
    #[pyo3(signature = (keys, values, *, method = "vq-4", name = "python", architecture = "python", token_ids = None, seed = 0, progress = None))]
    #[allow(clippy::too_many_arguments)]
    fn train(
        py: Python<'_>,
        keys: Vec<PyReadonlyArrayDyn<'_, f32>>,
        values: Vec<PyReadonlyArrayDyn<'_, f32>>,
        method: &str,
        name: &str,
        architecture: &str,
        token_ids: Option<Vec<u32>>,
        seed: u64,
        progress: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        let m = parse_method(method)?;
        let Method::VecInfer(vq) = m else {
            return Err(crate::errors::MethodError::new_err(format!(
                "{m} has no codebooks to train (a vq-… method does)"
            )));
        };
        let first = keys.first().ok_or_else(|| ShapeError::new_err("train: no layers"))?;
        let &[tokens, heads, dim] = first.shape() else {
            return Err(ShapeError::new_err(format!(
                "keys[0]: expected [tokens, kv_heads, head_dim], got {:?}",
                first.shape()
            )));
        };
        if values.len() != keys.len() {
            return Err(ShapeError::new_err(format!("{} layers of keys, {} of values", keys.len(), values.len())));
        }
        let shape = [Some(tokens), Some(heads), Some(dim)];
        let mut layers = Vec::with_capacity(keys.len());
        for (i, (k, v)) in keys.iter().zip(&values).enumerate() {
            layers.push(LayerActivations {
                keys: rows(k, &shape, &format!("keys[{i}]"))?.to_vec(),
                values: rows(v, &shape, &format!("values[{i}]"))?.to_vec(),
                ..LayerActivations::default()
            });
        }
        let text = token_ids.map(|ids| TextFingerprint::of_tokens(&ids)).unwrap_or_default();
        let acts = Activations { layers, text };
        let id = ModelIdentity {
            name: name.into(),
            architecture: architecture.into(),
            n_layers: keys.len(),
            n_kv_heads: heads,
            head_dim: dim,
        };
        let total = keys.len();
        let mut callback_error = None;
        let cal = py
            .detach(|| {
                calibrate_for(&id, &acts, vq.keys, vq.values, seed, &mut |done| {
                    if let (Some(f), None) = (&progress, &callback_error) {
                        if let Err(e) = Python::attach(|py| f.call1(py, (done, total))) {
                            callback_error = Some(e);
                        }
                    }
                })
            })
            .py()?;
        if let Some(e) = callback_error {
            return Err(e);
        }
        Ok(Self { inner: Arc::new(cal) })
    }

    /// Writes the artifact (safetensors, the format `veloq calibrate` writes).
    fn save(&self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .map_err(|e| ConfigError::new_err(format!("creating {}: {e}", dir.display())))?;
        }
        py.detach(|| self.inner.save(&path)).py()
    }

    /// Decoder layers.
    #[getter]
    fn layers(&self) -> usize {
        self.inner.layers.len()
    }

    /// Key/value heads per layer.
    #[getter]
    fn kv_heads(&self) -> usize {
        self.inner.model.n_kv_heads
    }

    /// Channels per head.
    #[getter]
    fn head_dim(&self) -> usize {
        self.inner.model.head_dim
    }

    /// The model it was calibrated on (its `general.name`).
    #[getter]
    fn model(&self) -> String {
        self.inner.model.name.clone()
    }

    /// The method it calibrates (`vq-4`, …).
    #[getter]
    fn method(&self) -> String {
        Method::of_calibration(&self.inner).to_string()
    }

    /// Bits per element with every stored byte counted (codebooks amortised over `tokens`).
    #[pyo3(signature = (tokens = 4096))]
    fn bits_per_element(&self, tokens: usize) -> f64 {
        self.inner.bits_per_element(tokens)
    }

    /// Codes of `x` (`[tokens, kv_heads, head_dim]` float32: a layer's post-RoPE keys or its
    /// values, `side` "keys" or "values"), packed, as a uint8 array.
    fn quantize<'py>(
        &self,
        py: Python<'py>,
        layer: usize,
        side: &str,
        x: PyReadonlyArrayDyn<'py, f32>,
    ) -> PyResult<Bound<'py, PyArray1<u8>>> {
        let c = self.codec(layer, side)?;
        let data = rows(&x, &[None, Some(c.n_heads()), Some(c.head_dim())], "quantize")?;
        let codes = py.detach(|| c.encode_vec(data)).py()?;
        Ok(codes.into_pyarray(py))
    }

    /// The vectors `codes` (from `quantize`) stand for, `[tokens, kv_heads, head_dim]` float32.
    fn dequantize<'py>(
        &self,
        py: Python<'py>,
        layer: usize,
        side: &str,
        codes: PyReadonlyArrayDyn<'py, u8>,
    ) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
        let c = self.codec(layer, side)?;
        let bytes = codes.as_slice().map_err(|_| ShapeError::new_err("dequantize: codes must be C-contiguous"))?;
        let row = c.n_heads() * c.head_dim();
        // Tokens from the packed length: the smallest count whose codes take these bytes.
        let guess = (bytes.len() * 8) / (c.n_heads() * c.subspaces() * c.shape().bits as usize).max(1);
        let tokens = (guess.saturating_sub(1)..=guess + 1)
            .find(|&t| t > 0 && c.code_bytes(t) == bytes.len())
            .ok_or_else(|| {
                ShapeError::new_err(format!("dequantize: {} bytes are no whole number of tokens' codes", bytes.len()))
            })?;
        let mut out = vec![0f32; tokens * row];
        py.detach(|| c.decode(bytes, &mut out)).py()?;
        out.into_pyarray(py).reshape(vec![tokens, c.n_heads(), c.head_dim()])
    }

    fn __repr__(&self) -> String {
        format!(
            "veloq.Calibration(model={:?}, method={:?}, layers={}, kv_heads={}, head_dim={})",
            self.inner.model.name,
            self.method(),
            self.layers(),
            self.kv_heads(),
            self.head_dim()
        )
    }
}

/// One model's KV cache for `batch` sequences, kept by veloq: codes (or f16 rows) per layer,
/// attended by veloq's kernels. Each `attend` call appends a step's keys and values to a layer
/// and returns the step's causal attention over everything that layer holds.
#[pyclass(module = "veloq", frozen)]
pub struct KvCache {
    caches: Mutex<ModelCache>,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    method: Method,
}

#[pymethods]
impl KvCache {
    /// A cache of `method` for a model of `q_heads` query heads. A VecInfer method takes the
    /// model's geometry from `calibration`; the others need `layers`, `kv_heads` and `head_dim`.
    /// `windows` gives the sliding window of each layer (None: global attention).
    #[new]
    #[pyo3(signature = (method = "vq-4", *, q_heads, calibration = None, layers = None, kv_heads = None, head_dim = None, windows = None, max_context = 8192, batch = 1, kernels = "auto"))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        method: &str,
        q_heads: usize,
        calibration: Option<&Bound<'_, PyAny>>,
        layers: Option<usize>,
        kv_heads: Option<usize>,
        head_dim: Option<usize>,
        windows: Option<Vec<Option<usize>>>,
        max_context: usize,
        batch: usize,
        kernels: &str,
    ) -> PyResult<Self> {
        let method = parse_method(method)?;
        let kernels = kernels.parse::<veloq::kernels::KernelChoice>().py()?;
        let cal = match calibration {
            None => None,
            Some(c) => Some(match c.cast::<Calibration>() {
                Ok(c) => c.get().inner.clone(),
                Err(_) => Arc::new(RustCalibration::load(c.extract::<PathBuf>()?).py()?),
            }),
        };
        let identity = match (&cal, layers, kv_heads, head_dim) {
            (Some(c), ..) => {
                for (given, has, what) in [
                    (layers, c.model.n_layers, "layers"),
                    (kv_heads, c.model.n_kv_heads, "kv_heads"),
                    (head_dim, c.model.head_dim, "head_dim"),
                ] {
                    if given.is_some_and(|g| g != has) {
                        return Err(crate::errors::CalibrationError::new_err(format!(
                            "the calibration is for {has} {what}, the cache was asked for {}",
                            given.unwrap_or_default()
                        )));
                    }
                }
                c.model.clone()
            }
            (None, Some(n_layers), Some(n_kv_heads), Some(head_dim)) => {
                ModelIdentity { name: "python".into(), architecture: "python".into(), n_layers, n_kv_heads, head_dim }
            }
            _ => {
                return Err(ConfigError::new_err(format!(
                    "{method} needs layers, kv_heads and head_dim (or a calibration to take them from)"
                )))
            }
        };
        if q_heads == 0 || !q_heads.is_multiple_of(identity.n_kv_heads) {
            return Err(ConfigError::new_err(format!(
                "q_heads {q_heads} must be a multiple of kv_heads {}",
                identity.n_kv_heads
            )));
        }
        if batch == 0 || max_context == 0 {
            return Err(ConfigError::new_err("batch and max_context must be at least 1"));
        }
        let windows = windows.unwrap_or_else(|| vec![None; identity.n_layers]);
        let (kv, d) = (identity.n_kv_heads, identity.head_dim);
        let config = CacheConfig::new(method, cal.map(|c| (*c).clone())).py()?;
        let config = CacheConfig { kernels, ..config };
        let g = Geometry { identity, q_heads, windows, max_context };
        let caches = config.build_for(&g, &CandleDevice::Cpu, batch).py()?;
        Ok(Self { caches: Mutex::new(caches), q_heads, kv_heads: kv, head_dim: d, method })
    }

    /// Appends keys and values `k`, `v` (`[batch, tokens, kv_heads, head_dim]` float32, post-RoPE,
    /// each sequence continuing where it ends) to `layer` and returns the causal attention of the
    /// step's queries `q` (`[batch, tokens, q_heads, head_dim]`) over everything the layer holds,
    /// `[batch, tokens, q_heads, head_dim]` float32. `scale` defaults to 1/√head_dim.
    #[pyo3(signature = (layer, q, k, v, scale = None))]
    fn attend<'py>(
        &self,
        py: Python<'py>,
        layer: usize,
        q: PyReadonlyArrayDyn<'py, f32>,
        k: PyReadonlyArrayDyn<'py, f32>,
        v: PyReadonlyArrayDyn<'py, f32>,
        scale: Option<f32>,
    ) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
        let (hq, hk, d) = (self.q_heads, self.kv_heads, self.head_dim);
        let dims = q.shape().to_vec();
        if dims.len() != 4 {
            return Err(ShapeError::new_err(format!("q: expected [batch, tokens, {hq}, {d}], got {dims:?}")));
        }
        let (b, t) = (dims[0], dims[1]);
        let qs = rows(&q, &[Some(b), Some(t), Some(hq), Some(d)], "q")?;
        let ks = rows(&k, &[Some(b), Some(t), Some(hk), Some(d)], "k")?;
        let vs = rows(&v, &[Some(b), Some(t), Some(hk), Some(d)], "v")?;
        let scale = scale.unwrap_or(1.0 / (d as f32).sqrt());
        let mut guard = self.lock();
        let caches = &mut *guard;
        if layer >= caches.layers().len() {
            return Err(ConfigError::new_err(format!("layer {layer}: the cache has {} layers", caches.layers().len())));
        }
        if b > caches.slots() || t == 0 {
            return Err(ShapeError::new_err(format!(
                "a step of {b} sequences × {t} tokens: the cache holds {} sequences",
                caches.slots()
            )));
        }
        let out = py
            .detach(|| -> veloq_candle::Result<Vec<f32>> {
                let dev = CandleDevice::Cpu;
                let starts: Vec<_> = (0..b).map(|s| caches.layers()[layer].len(s)).collect();
                let step = Step::new(
                    starts
                        .iter()
                        .enumerate()
                        .map(|(slot, &start)| veloq_candle::cache::SeqStep { slot, start, len: t })
                        .collect(),
                )?;
                let l = &mut caches.layers_mut()[layer];
                l.append(
                    &Tensor::from_slice(ks, (b * t, hk, d), &dev)?,
                    &Tensor::from_slice(vs, (b * t, hk, d), &dev)?,
                    &step,
                )?;
                let y = l.attend(&Tensor::from_slice(qs, (b * t, hq, d), &dev)?, &step, scale);
                let y = match y {
                    Ok(y) => y,
                    Err(e) => {
                        for (slot, &start) in starts.iter().enumerate() {
                            let _ = l.truncate(slot, start);
                        }
                        return Err(e);
                    }
                };
                l.commit()?;
                Ok(y.flatten_all()?.to_vec1::<f32>()?)
            })
            .py()?;
        out.into_pyarray(py).reshape(vec![b, t, hq, d])
    }

    /// Positions sequence `seq` holds in `layer`.
    #[pyo3(signature = (layer = 0, seq = 0))]
    fn length(&self, layer: usize, seq: usize) -> PyResult<usize> {
        let c = self.lock();
        let l = c.layers().get(layer).ok_or_else(|| ConfigError::new_err(format!("layer {layer} out of range")))?;
        if seq >= l.slots() {
            return Err(ConfigError::new_err(format!("sequence {seq}: the cache holds {}", l.slots())));
        }
        Ok(l.len(seq))
    }

    /// Keeps the first `length` positions of every sequence in every layer (0 empties the cache).
    #[pyo3(signature = (length = 0))]
    fn truncate(&self, length: usize) -> PyResult<()> {
        let mut c = self.lock();
        for slot in 0..c.slots() {
            let n = c.len(slot).min(length);
            c.truncate(slot, n).py()?;
        }
        Ok(())
    }

    /// Bytes the cache really holds (codes, rows and the codecs' tables as allocated).
    #[getter]
    fn resident_bytes(&self) -> usize {
        self.lock().resident_bytes()
    }

    /// The method's name.
    #[getter]
    fn method(&self) -> String {
        self.method.to_string()
    }

    /// Layers.
    #[getter]
    fn layers(&self) -> usize {
        self.lock().layers().len()
    }
}

impl KvCache {
    fn lock(&self) -> MutexGuard<'_, ModelCache> {
        self.caches.lock().unwrap_or_else(|p| p.into_inner())
    }
}
