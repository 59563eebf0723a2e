//! `KvCache`: veloq's cache for a model veloq does not run (the transformers integration's
//! layers) — keys and values appended, attention over codes with the kernels the runner uses, on
//! the CPU (NumPy arrays) or a CUDA device (CUDA arrays of any framework, read and written in
//! place on the caller's stream).

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::{Device as CandleDevice, Tensor};
use numpy::{IntoPyArray, PyArrayMethods, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::prelude::*;

use veloq::artifact::{Calibration as RustCalibration, ModelIdentity};
use veloq_candle::cache::{ModelCache, SeqStep, Step};
use veloq_candle::config::Geometry;
use veloq_candle::runtime::{CudaOptions, Device};
use veloq_candle::{CacheConfig, Method};

use crate::arrays::{self, CudaArray};
use crate::calibration::Calibration;
use crate::errors::{ConfigError, DeviceError, IntoPy, ShapeError};
use crate::model::parse_method;

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
    device: Device,
    candle: CandleDevice,
    /// A CPU cache's own pool for decode steps (`threads`); `None`: rayon's global pool.
    pool: Option<rayon::ThreadPool>,
    #[cfg(feature = "cuda")]
    exchange: Option<veloq_candle::interop::Exchange>,
}

/// A step's inputs as the caller gave them: all NumPy or all CUDA arrays.
enum Inputs<'py> {
    /// `heads_first`: the arrays are `[batch, heads, tokens, dim]`.
    Host {
        q: Option<PyReadonlyArrayDyn<'py, f32>>,
        k: PyReadonlyArrayDyn<'py, f32>,
        v: PyReadonlyArrayDyn<'py, f32>,
        heads_first: bool,
    },
    Cuda {
        q: Option<CudaArray>,
        k: CudaArray,
        v: CudaArray,
    },
}

#[pymethods]
impl KvCache {
    /// A cache of `method` for a model of `q_heads` query heads on `device` ("cpu", "cuda",
    /// "cuda:N"). A VecInfer method takes the model's geometry from `calibration`; the others
    /// need `layers`, `kv_heads` and `head_dim`. `windows` gives the sliding window of each layer
    /// (None: global attention). `threads`: on the CPU, run decode steps (one token a sequence)
    /// on a pool of this many threads of the cache's own; by default, and for prompts always,
    /// the process's pool (one thread a core). Inside another framework's forward pass, whose
    /// threads own the cores and spin between its ops, 1 is fastest for decode steps; a prompt's
    /// coding is long enough to gain from every core.
    #[new]
    #[pyo3(signature = (method = "vq-4", *, q_heads, calibration = None, layers = None, kv_heads = None, head_dim = None, windows = None, max_context = 8192, batch = 1, kernels = "auto", device = "cpu", threads = None))]
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
        device: &str,
        threads: Option<usize>,
    ) -> PyResult<Self> {
        let method = parse_method(method)?;
        let kernels = kernels.parse::<veloq::kernels::KernelChoice>().py()?;
        let device = device.parse::<Device>().py()?;
        let pool = match (threads, device) {
            (None, _) => None,
            (Some(0), _) => return Err(ConfigError::new_err("threads must be at least 1")),
            (Some(_), Device::Cuda(_)) => {
                return Err(ConfigError::new_err(format!("threads is for a cache on the CPU; this one is on {device}")))
            }
            (Some(n), Device::Cpu) => Some(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(n)
                    .thread_name(|i| format!("veloq-kv-{i}"))
                    .build()
                    .map_err(|e| ConfigError::new_err(format!("starting {n} threads: {e}")))?,
            ),
        };
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
        let candle = device.open(&CudaOptions::default()).py()?;
        let caches = config.build_for(&g, &candle, batch).py()?;
        Ok(Self {
            caches: Mutex::new(caches),
            q_heads,
            kv_heads: kv,
            head_dim: d,
            method,
            device,
            #[cfg(feature = "cuda")]
            exchange: match device {
                Device::Cuda(_) => Some(veloq_candle::interop::Exchange::new(&candle).py()?),
                Device::Cpu => None,
            },
            candle,
            pool,
        })
    }

    /// Appends keys and values `k`, `v` (`[batch, tokens, kv_heads, head_dim]` float32, post-RoPE,
    /// each sequence continuing where it ends) to `layer` and returns the causal attention of the
    /// step's queries `q` (`[batch, tokens, q_heads, head_dim]`) over everything the layer holds,
    /// `[batch, tokens, q_heads, head_dim]` float32. `scale` defaults to 1/√head_dim.
    ///
    /// NumPy arrays in, a NumPy array out. On a CUDA cache the arrays may instead be CUDA arrays
    /// (torch CUDA tensors, or any array with `__cuda_array_interface__`: CuPy, Numba), float32,
    /// float16 or (torch) bfloat16, each C-contiguous and converted in the copy that reads it:
    /// then the attention is written into `out` (a CUDA array of the output's shape, any of those
    /// types), which is returned, and the work is ordered after what `stream` (a `CUstream`
    /// handle, e.g. `torch.cuda.current_stream().cuda_stream`; by default the one the arrays
    /// name, else the default stream) has queued, and before whatever it queues next.
    ///
    /// `heads_first`: `q`, `k` and `v` are given as `[batch, heads, tokens, head_dim]`, the layout
    /// transformers' attention functions receive; CUDA arrays must then be transposed views of
    /// C-contiguous `[batch, tokens, heads, head_dim]` memory (what attention projections make:
    /// read in place), NumPy arrays may be anything (copied where they are not such views). The
    /// output keeps `[batch, tokens, q_heads, head_dim]`, the layout those functions return.
    #[pyo3(signature = (layer, q, k, v, scale = None, *, out = None, stream = None, heads_first = false))]
    #[allow(clippy::too_many_arguments)]
    fn attend<'py>(
        &self,
        py: Python<'py>,
        layer: usize,
        q: &Bound<'py, PyAny>,
        k: &Bound<'py, PyAny>,
        v: &Bound<'py, PyAny>,
        scale: Option<f32>,
        out: Option<&Bound<'py, PyAny>>,
        stream: Option<u64>,
        heads_first: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (hq, d) = (self.q_heads, self.head_dim);
        let inputs = self.inputs(Some(q), k, v, heads_first)?;
        let (b, t) = batch_tokens(&inputs);
        let scale = scale.unwrap_or(1.0 / (d as f32).sqrt());
        match inputs {
            Inputs::Host { q, k, v, heads_first } => {
                if out.is_some() {
                    return Err(ShapeError::new_err("out= is for CUDA arrays; NumPy inputs return a new array"));
                }
                let q = q.expect("attend has queries");
                let (qs, ks, vs) = (slice(&q, heads_first)?, slice(&k, heads_first)?, slice(&v, heads_first)?);
                let (qs, ks, vs) = (&*qs, &*ks, &*vs);
                let dev = self.candle.clone();
                let y = py
                    .detach(|| {
                        self.on_pool(t, || -> veloq_candle::Result<Vec<f32>> {
                            let (kt, vt) = (self.kv_tensor(ks, b * t, &dev)?, self.kv_tensor(vs, b * t, &dev)?);
                            let qt = Tensor::from_slice(qs, (b * t, hq, d), &dev)?;
                            let y = step(&mut self.lock(), layer, b, t, &kt, &vt, Some((&qt, scale, None)), None)?;
                            Ok(y.expect("attend returns attention").flatten_all()?.to_vec1::<f32>()?)
                        })
                    })
                    .py()?;
                Ok(y.into_pyarray(py).reshape(vec![b, t, hq, d])?.into_any())
            }
            Inputs::Cuda { q, k, v } => {
                let out = out.ok_or_else(|| {
                    ShapeError::new_err(format!(
                        "attend over CUDA arrays writes into out=: a CUDA array [{b}, {t}, {hq}, {d}] (float32, float16 or bfloat16)"
                    ))
                })?;
                let o = CudaArray::of(out, &[Some(b), Some(t), Some(hq), Some(d)], "out", true)?
                    .ok_or_else(|| ShapeError::new_err("out: expected a CUDA array like k"))?;
                self.same_device(&o, "out")?;
                let stream = stream.or(k.stream).unwrap_or(0);
                py.detach(|| self.device_step(layer, b, t, q.as_ref().map(|q| (q, &o, scale)), &k, &v, None, stream))?;
                Ok(out.clone())
            }
        }
    }

    /// Appends keys and values `k`, `v` (as in `attend`) to `layer` without attending: a prompt
    /// whose attention the caller computed itself (the first chunk of a prompt attends only to
    /// itself, exactly, whatever the cache stores). Positions leaving the recent window become
    /// codes as in `attend`. NumPy or (on a CUDA cache) CUDA arrays, ordered on `stream` as there.
    ///
    /// `skip`: for each sequence, how many of its first tokens to leave out — the left padding of
    /// a batch of prompts of different lengths, which attention masks out and the cache then never
    /// holds (each sequence continues from its own length; a sequence may skip all its tokens).
    #[pyo3(signature = (layer, k, v, *, stream = None, heads_first = false, skip = None))]
    #[allow(clippy::too_many_arguments)]
    fn append(
        &self,
        py: Python<'_>,
        layer: usize,
        k: &Bound<'_, PyAny>,
        v: &Bound<'_, PyAny>,
        stream: Option<u64>,
        heads_first: bool,
        skip: Option<Vec<usize>>,
    ) -> PyResult<()> {
        let inputs = self.inputs(None, k, v, heads_first)?;
        let (b, t) = batch_tokens(&inputs);
        if let Some(skip) = &skip {
            if skip.len() != b || skip.iter().any(|&s| s > t) {
                return Err(ShapeError::new_err(format!(
                    "skip: one count a sequence, each at most its {t} tokens, for {b} sequences; got {skip:?}"
                )));
            }
        }
        let skip = skip.as_deref();
        match inputs {
            Inputs::Host { k, v, heads_first, .. } => {
                let (ks, vs) = (slice(&k, heads_first)?, slice(&v, heads_first)?);
                let (ks, vs) = (&*ks, &*vs);
                let dev = self.candle.clone();
                py.detach(|| {
                    self.on_pool(t, || -> veloq_candle::Result<()> {
                        let (kt, vt) = (self.kv_tensor(ks, b * t, &dev)?, self.kv_tensor(vs, b * t, &dev)?);
                        step(&mut self.lock(), layer, b, t, &kt, &vt, None, skip).map(drop)
                    })
                })
                .py()
            }
            Inputs::Cuda { k, v, .. } => {
                let stream = stream.or(k.stream).unwrap_or(0);
                py.detach(|| self.device_step(layer, b, t, None, &k, &v, skip, stream))
            }
        }
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

    /// Keeps the first `length` positions of every sequence in every layer (0 empties the cache);
    /// `layer` and `seq` narrow the cut to one layer or one sequence (a rollback: speculative
    /// decoding takes back the draft tokens its model rejected).
    #[pyo3(signature = (length = 0, *, layer = None, seq = None))]
    fn truncate(&self, length: usize, layer: Option<usize>, seq: Option<usize>) -> PyResult<()> {
        let mut c = self.lock();
        let (slots, layers) = (c.slots(), c.layers().len());
        if let Some(s) = seq.filter(|&s| s >= slots) {
            return Err(ConfigError::new_err(format!("sequence {s}: the cache holds {slots}")));
        }
        if let Some(i) = layer.filter(|&i| i >= layers) {
            return Err(ConfigError::new_err(format!("layer {i} out of range")));
        }
        let seqs = seq.map_or(0..slots, |s| s..s + 1);
        for l in &mut c.layers_mut()[layer.map_or(0..layers, |i| i..i + 1)] {
            for slot in seqs.clone() {
                let n = l.len(slot).min(length);
                l.truncate(slot, n).py()?;
            }
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

    /// Where the cache lives ("cpu", "cuda:0").
    #[getter]
    fn device(&self) -> String {
        self.device.to_string()
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

    /// The step's arrays, all of one kind and shaped `[batch, tokens, heads, head_dim]` alike
    /// (`[batch, heads, tokens, head_dim]` where `heads_first`).
    fn inputs<'py>(
        &self,
        q: Option<&Bound<'py, PyAny>>,
        k: &Bound<'py, PyAny>,
        v: &Bound<'py, PyAny>,
        heads_first: bool,
    ) -> PyResult<Inputs<'py>> {
        let (hq, hk, d) = (self.q_heads, self.kv_heads, self.head_dim);
        let kv_shape = [None, None, Some(hk), Some(d)];
        let Some(kc) = CudaArray::steps(k, &kv_shape, "k", false, heads_first)? else {
            let k: PyReadonlyArrayDyn<'py, f32> = k.extract()?;
            arrays::check_host_steps(&k, &kv_shape, "k", heads_first)?;
            let t_axis = if heads_first { 2 } else { 1 };
            let (b, t) = (k.shape()[0], k.shape()[t_axis]);
            let shape = |h| [Some(b), Some(t), Some(h), Some(d)];
            let q: Option<PyReadonlyArrayDyn<'py, f32>> = q.map(|q| q.extract()).transpose()?;
            if let Some(q) = &q {
                arrays::check_host_steps(q, &shape(hq), "q", heads_first)?;
            }
            let v: PyReadonlyArrayDyn<'py, f32> = v.extract()?;
            arrays::check_host_steps(&v, &shape(hk), "v", heads_first)?;
            return Ok(Inputs::Host { q, k, v, heads_first });
        };
        if self.device == Device::Cpu {
            return Err(DeviceError::new_err(
                "CUDA arrays given to a cache on the CPU: build the KvCache with device=\"cuda\"",
            ));
        }
        let (b, t) = (kc.shape[0], kc.shape[1]);
        let shape = |h| [Some(b), Some(t), Some(h), Some(d)];
        self.same_device(&kc, "k")?;
        let cuda = |x: &Bound<'py, PyAny>, h, what| {
            let a = CudaArray::steps(x, &shape(h), what, false, heads_first)?
                .ok_or_else(|| ShapeError::new_err(format!("{what}: expected a CUDA array like k")))?;
            self.same_device(&a, what)?;
            Ok::<_, PyErr>(a)
        };
        let q = q.map(|q| cuda(q, hq, "q")).transpose()?;
        let v = cuda(v, hk, "v")?;
        Ok(Inputs::Cuda { q, k: kc, v })
    }

    /// Runs a step of `t` tokens a sequence: a decode step on the cache's own pool if it has one
    /// (its kernels' parallel loops then use it), anything else where it is called.
    fn on_pool<R: Send>(&self, t: usize, f: impl FnOnce() -> R + Send) -> R {
        match &self.pool {
            Some(p) if t == 1 => p.install(f),
            _ => f(),
        }
    }

    /// Refuses an array on another GPU than the cache's (where the array says which).
    fn same_device(&self, a: &CudaArray, what: &str) -> PyResult<()> {
        match (a.device, self.device) {
            (Some(i), Device::Cuda(j)) if i != j => {
                Err(DeviceError::new_err(format!("{what} is on cuda:{i}; the cache is on {}", self.device)))
            }
            _ => Ok(()),
        }
    }

    fn kv_tensor(&self, x: &[f32], tokens: usize, dev: &CandleDevice) -> candle_core::Result<Tensor> {
        Tensor::from_slice(x, (tokens, self.kv_heads, self.head_dim), dev)
    }

    /// A step over CUDA arrays: read on veloq's stream after `stream`'s writes, attention (if
    /// asked) written into its output array, and `stream` ordered after all of it.
    #[cfg(feature = "cuda")]
    #[allow(clippy::too_many_arguments)]
    fn device_step(
        &self,
        layer: usize,
        b: usize,
        t: usize,
        q: Option<(&CudaArray, &CudaArray, f32)>,
        k: &CudaArray,
        v: &CudaArray,
        skip: Option<&[usize]>,
        stream: u64,
    ) -> PyResult<()> {
        use veloq_candle::interop::{ForeignBuffer, ForeignStream};
        let ex = self.exchange.as_ref().expect("a CUDA cache has an exchange");
        let stream = ForeignStream(stream);
        let buf = |a: &CudaArray| ForeignBuffer { ptr: a.ptr, len: a.elements(), dtype: a.elem };
        let (hq, hk, d) = (self.q_heads, self.kv_heads, self.head_dim);
        ex.after(stream).py()?;
        let run = || -> veloq_candle::Result<()> {
            let mut stage = ex.stage();
            let (kv, qs) = ([b * t, hk, d], [b * t, hq, d]);
            let mut srcs = vec![(buf(k), &kv[..]), (buf(v), &kv[..])];
            if let Some((q, _, _)) = q {
                srcs.push((buf(q), &qs[..]));
            }
            // SAFETY: the arrays were checked to be C-contiguous, of these shapes and types; the
            // caller's stream waits for this work (`before` below) before it touches them again.
            let read = unsafe { stage.read(&srcs)? };
            let (kt, vt) = (&read[0], &read[1]);
            let Some((_, out, scale)) = q else {
                return step(&mut self.lock(), layer, b, t, kt, vt, None, skip).map(drop);
            };
            let y = stage.output(&qs)?;
            step(&mut self.lock(), layer, b, t, kt, vt, Some((&read[2], scale, Some(&y))), None)?;
            // SAFETY: as above; `out` was checked writable and of the output's shape.
            unsafe { stage.write(&y, buf(out)) }
        };
        let r = run();
        // Whatever happened, the caller's stream must not reuse the arrays before the copies ran.
        let ordered = ex.before(stream);
        r.py()?;
        ordered.py()
    }

    #[cfg(not(feature = "cuda"))]
    #[allow(clippy::too_many_arguments)]
    fn device_step(
        &self,
        _layer: usize,
        _b: usize,
        _t: usize,
        _q: Option<(&CudaArray, &CudaArray, f32)>,
        _k: &CudaArray,
        _v: &CudaArray,
        _skip: Option<&[usize]>,
        _stream: u64,
    ) -> PyResult<()> {
        Err(DeviceError::new_err("this veloq was built without CUDA (pip install with the cuda feature)"))
    }
}

/// The data of a host array whose shape [`KvCache::inputs`] checked, `[batch, tokens, heads,
/// dim]` in memory (copied into that order if it was given heads first in another).
fn slice<'a>(x: &'a PyReadonlyArrayDyn<'_, f32>, heads_first: bool) -> PyResult<std::borrow::Cow<'a, [f32]>> {
    arrays::host_steps(x, &[None; 4], "array", heads_first)
}

fn batch_tokens(inputs: &Inputs<'_>) -> (usize, usize) {
    match inputs {
        Inputs::Host { k, heads_first, .. } => (k.shape()[0], k.shape()[if *heads_first { 2 } else { 1 }]),
        Inputs::Cuda { k, .. } => (k.shape[0], k.shape[1]),
    }
}

/// Appends `k`, `v` (`[batch × tokens, kv heads, head_dim]`, every sequence `tokens` long,
/// continuing where it ends; without the first `skip[s]` tokens of sequence `s` if given) to
/// `layer`, attends `q` (queries, scale and, if given, the tensor the attention is written into —
/// then nothing is returned) if given, and settles the step; a step that fails leaves every
/// sequence as it was.
#[allow(clippy::too_many_arguments)]
fn step(
    caches: &mut ModelCache,
    layer: usize,
    b: usize,
    t: usize,
    k: &Tensor,
    v: &Tensor,
    q: Option<(&Tensor, f32, Option<&Tensor>)>,
    skip: Option<&[usize]>,
) -> veloq_candle::Result<Option<Tensor>> {
    use veloq_candle::Error;
    let n_layers = caches.layers().len();
    if layer >= n_layers {
        return Err(Error::Config(format!("layer {layer}: the cache has {n_layers} layers")));
    }
    if b == 0 || b > caches.slots() || t == 0 {
        return Err(Error::Shape(format!(
            "a step of {b} sequences × {t} tokens: the cache holds {} sequences",
            caches.slots()
        )));
    }
    let l = &mut caches.layers_mut()[layer];
    let starts: Vec<_> = (0..b).map(|s| l.len(s)).collect();
    let skipped = |s: usize| skip.map_or(0, |k| k[s]);
    let seqs: Vec<_> = (0..b)
        .filter(|&s| skipped(s) < t)
        .map(|slot| SeqStep { slot, start: starts[slot], len: t - skipped(slot) })
        .collect();
    if seqs.is_empty() && q.is_none() {
        return Ok(None); // every sequence skipped all its tokens
    }
    let step = Step::new(seqs)?;
    // The rows kept, packed: sequence s's last t - skip[s] tokens.
    let (k, v) = if (0..b).any(|s| skipped(s) > 0) {
        let rows: Vec<u32> = (0..b).flat_map(|s| (s * t + skipped(s)..(s + 1) * t).map(|r| r as u32)).collect();
        let rows = Tensor::from_vec(rows, step.tokens(), k.device())?;
        (k.index_select(&rows, 0)?, v.index_select(&rows, 0)?)
    } else {
        (k.clone(), v.clone())
    };
    l.append(&k, &v, &step)?;
    let y = match q {
        Some((q, scale, Some(out))) => l.attend_into(q, &step, scale, out).map(|()| None),
        Some((q, scale, None)) => l.attend(q, &step, scale).map(Some),
        None => Ok(None),
    };
    let settled = y.and_then(|y| l.commit().map(|()| y));
    if settled.is_err() {
        for (slot, &start) in starts.iter().enumerate() {
            let _ = l.truncate(slot, start);
        }
    }
    settled
}
