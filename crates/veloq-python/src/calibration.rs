//! `Calibration`: a VecInfer calibration artifact from Python — loaded, trained from a model's
//! own keys and values (NumPy arrays), saved, and used to quantize and dequantize one layer's
//! keys or values.

use std::path::PathBuf;
use std::sync::Arc;

use numpy::{IntoPyArray, PyArray1, PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::prelude::*;

use veloq::artifact::{Calibration as RustCalibration, ModelIdentity};
use veloq::calibrate::TextFingerprint;
use veloq::codec::vecinfer::VecInferCodec;
use veloq_candle::collect::{calibrate_for, Activations, LayerActivations};
use veloq_candle::Method;

use crate::arrays;
use crate::errors::{ConfigError, IntoPy, ShapeError};
use crate::model::parse_method;

/// A VecInfer calibration: every layer's key and value codecs.
#[pyclass(module = "veloq", frozen)]
pub struct Calibration {
    pub(crate) inner: Arc<RustCalibration>,
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
                keys: arrays::host(k, &shape, &format!("keys[{i}]"))?.to_vec(),
                values: arrays::host(v, &shape, &format!("values[{i}]"))?.to_vec(),
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
        let data = arrays::host(&x, &[None, Some(c.n_heads()), Some(c.head_dim())], "quantize")?;
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
