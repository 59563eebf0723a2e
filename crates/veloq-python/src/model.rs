//! `veloq.Model`: a GGUF model with its tokenizer and the caches of a method, opened through the
//! library's front door ([`veloq_candle::runtime::load`]); `generate` (whole text or a streaming
//! iterator) and `Chat`.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use pyo3::exceptions::{PyStopIteration, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use veloq_candle::cache::ModelCache;
use veloq_candle::chat::{Chat as RustChat, Conversation};
use veloq_candle::generate::{prompt_ids, Decoding, Event, Finish, GenerateOptions, GenerateOutput};
use veloq_candle::model::{decode, encode, Tokenizer};
use veloq_candle::runtime::{self, calibration_path, Device, RunOptions};
use veloq_candle::sampling::SamplingOptions;
use veloq_candle::{CacheConfig, Forward, Method};

use crate::errors::{ConfigError, IntoPy};

/// A GGUF model opened with the caches of one method.
#[pyclass(module = "veloq", frozen)]
pub struct Model {
    pub(crate) runner: Arc<dyn Forward>,
    pub(crate) tokenizer: Arc<Tokenizer>,
    pub(crate) cache: CacheConfig,
    pub(crate) path: PathBuf,
    pub(crate) method: Method,
    pub(crate) device: Device,
}

/// The method, device and kernel switch parsed as the CLI parses them.
pub fn parse_method(method: &str) -> PyResult<Method> {
    method.parse::<Method>().py()
}

#[pymethods]
impl Model {
    /// Opens the GGUF file at `path` with the caches of `method` (default "vq-4"). A VecInfer
    /// method loads `calibration`, by default `<cache>/<model>.<method>.safetensors` with
    /// `<cache>` `$VELOQ_CACHE` or `~/.cache/veloq` (what `veloq.calibrate` and `veloq calibrate`
    /// write). `weights` is what the file's quantized weights are multiplied as: "stored" (its
    /// blocks), "f16" (dequantized; faster products on CUDA) or "f32" (the same arithmetic on
    /// every device).
    #[staticmethod]
    #[pyo3(signature = (path, method = "vq-4", calibration = None, device = "cpu", max_context = 8192, kernels = "auto", weights = "stored"))]
    #[allow(clippy::too_many_arguments)]
    fn open(
        py: Python<'_>,
        path: PathBuf,
        method: &str,
        calibration: Option<PathBuf>,
        device: &str,
        max_context: usize,
        kernels: &str,
        weights: &str,
    ) -> PyResult<Self> {
        let method = parse_method(method)?;
        let device = device.parse::<Device>().py()?;
        let kernels = kernels.parse::<veloq::kernels::KernelChoice>().py()?;
        let weights = weights.parse::<veloq_candle::model::Weights>().py()?;
        if max_context == 0 {
            return Err(ConfigError::new_err("max_context must be at least 1"));
        }
        let calibration = match (method.needs_calibration(), calibration) {
            (true, None) => Some(calibration_path(&crate::cache_dir(), &path, &method)),
            (_, c) => c,
        };
        // A method that takes none is refused one by `runtime::load`.
        if let Some(c) = calibration.as_ref().filter(|c| method.needs_calibration() && !c.exists()) {
            return Err(crate::errors::CalibrationError::new_err(format!(
                "no calibration for {method} at {} (make one with veloq.calibrate({:?}, method={:?}))",
                c.display(),
                path.display(),
                method.to_string()
            )));
        }
        let options = RunOptions { device, kernels, max_context, weights, ..RunOptions::default() };
        let loaded = py.detach(|| runtime::load(&path, &method, calibration.as_deref(), &options)).py()?;
        Ok(Self {
            runner: Arc::new(loaded.runner),
            tokenizer: Arc::new(loaded.tokenizer),
            cache: loaded.cache,
            path,
            method,
            device,
        })
    }

    /// The method's name (`vq-4`, `fp16`, …).
    #[getter]
    fn method(&self) -> String {
        self.method.to_string()
    }

    /// Where the model runs (`cpu`, `cuda:0`).
    #[getter]
    fn device(&self) -> String {
        self.device.to_string()
    }

    /// The GGUF file.
    #[getter]
    fn path(&self) -> PathBuf {
        self.path.clone()
    }

    /// The longest context (prompt and generated tokens) a sequence may reach.
    #[getter]
    fn max_context(&self) -> usize {
        self.runner.model().max_context()
    }

    /// The model's geometry and the method's rate, as a dict: name, architecture, layers, heads,
    /// kv_heads, head_dim, vocab, method, bits_per_element (codebooks amortised over 4,096 tokens).
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let m = self.runner.model();
        let id = &m.info.identity;
        let d = PyDict::new(py);
        d.set_item("name", &id.name)?;
        d.set_item("architecture", &id.architecture)?;
        d.set_item("layers", id.n_layers)?;
        d.set_item("heads", m.info.n_heads)?;
        d.set_item("kv_heads", id.n_kv_heads)?;
        d.set_item("head_dim", id.head_dim)?;
        d.set_item("vocab", m.info.vocab)?;
        d.set_item("method", self.method.to_string())?;
        d.set_item("bits_per_element", self.cache.code_bits_per_element(m, 4096).py()?)?;
        Ok(d)
    }

    /// Token ids of `text` (no BOS, no template).
    fn tokenize(&self, py: Python<'_>, text: &str) -> PyResult<Vec<u32>> {
        py.detach(|| encode(&self.tokenizer, text)).py()
    }

    /// The text of token ids.
    fn detokenize(&self, ids: Vec<u32>) -> PyResult<String> {
        decode(&self.tokenizer, &ids).py()
    }

    /// Generates after `prompt` (in the model's chat template unless `chat=False`). Returns the
    /// text, or with `stream=True` an iterator over its pieces as they come (its `result` holds
    /// the tokens, finish reason and timings once it is exhausted). Sampling keywords as
    /// [`options`] lists them (128 tokens, greedy by default).
    #[pyo3(signature = (prompt, *, chat = true, stream = false, **sampling))]
    fn generate(
        slf: Bound<'_, Self>,
        prompt: &str,
        chat: bool,
        stream: bool,
        sampling: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        let opts = options(sampling, 128)?;
        let model = slf.get();
        let ids = prompt_ids(model.runner.model(), &model.tokenizer, prompt, chat).py()?;
        let g = Generation::start(py, slf.clone().unbind(), &ids, &opts)?;
        if stream {
            return Ok(Py::new(py, g)?.into_any());
        }
        let mut text = String::new();
        while let Some(piece) = g.next_piece(py)? {
            text.push_str(&piece);
        }
        Ok(text.into_pyobject(py)?.into_any().unbind())
    }

    /// A new conversation whose history stays in the caches: each turn feeds only its new tokens.
    fn chat(slf: Bound<'_, Self>) -> PyResult<Chat> {
        let m = slf.get();
        let caches = m.cache.build(m.runner.model()).py()?;
        let conversation = RustChat::new(&*m.runner, &m.tokenizer, caches).into_conversation();
        Ok(Chat { model: slf.unbind(), state: Mutex::new(Some(conversation)) })
    }

    fn __repr__(&self) -> String {
        format!(
            "veloq.Model({:?}, method={:?}, device={:?})",
            self.path.display().to_string(),
            self.method.to_string(),
            self.device.to_string()
        )
    }
}

/// The sampling keywords `generate` and `Chat.say` take, over `max_tokens` tokens by default:
/// max_tokens, temperature (0: greedy), top_p, top_k, min_p, repetition_penalty,
/// presence_penalty, frequency_penalty, seed. The library checks their values when generation
/// starts; a keyword outside these is a TypeError here.
fn options(kwargs: Option<&Bound<'_, PyDict>>, max_tokens: usize) -> PyResult<GenerateOptions> {
    let mut o = GenerateOptions { max_tokens, sampling: SamplingOptions::default(), ..GenerateOptions::default() };
    for (k, v) in kwargs.into_iter().flat_map(|d| d.iter()) {
        let key: String = k.extract()?;
        let wrong = |e: PyErr| PyTypeError::new_err(format!("{key}: {e}"));
        let s = &mut o.sampling;
        match key.as_str() {
            "max_tokens" => o.max_tokens = v.extract().map_err(wrong)?,
            "temperature" => s.temperature = v.extract().map_err(wrong)?,
            "top_p" => s.top_p = v.extract().map_err(wrong)?,
            "top_k" => s.top_k = v.extract().map_err(wrong)?,
            "min_p" => s.min_p = v.extract().map_err(wrong)?,
            "repetition_penalty" => s.repetition_penalty = v.extract().map_err(wrong)?,
            "presence_penalty" => s.presence_penalty = v.extract().map_err(wrong)?,
            "frequency_penalty" => s.frequency_penalty = v.extract().map_err(wrong)?,
            "seed" => s.seed = v.extract::<Option<u64>>().map_err(wrong)?.unwrap_or(s.seed),
            _ => {
                return Err(PyTypeError::new_err(format!(
                    "unexpected keyword argument {key:?} (sampling takes max_tokens, temperature, top_p, top_k, \
                     min_p, repetition_penalty, presence_penalty, frequency_penalty, seed)"
                )))
            }
        }
    }
    Ok(o)
}

/// What a generation produced: `text`, `tokens`, `finish_reason` ("stop", "length",
/// "context"), `prompt_tokens`, timings and the cache's resident bytes against an f16 cache's.
#[pyclass(module = "veloq", name = "Result", frozen, get_all)]
#[derive(Clone)]
pub struct Result_ {
    /// The generated text.
    text: String,
    /// The generated token ids.
    tokens: Vec<u32>,
    /// Why it stopped.
    finish_reason: &'static str,
    /// Tokens fed before generating.
    prompt_tokens: usize,
    /// Seconds to the first token.
    prefill_s: f64,
    /// Seconds of decode after it.
    decode_s: f64,
    /// Bytes the caches hold.
    kv_resident_bytes: usize,
    /// Bytes an f16 cache of the same positions would hold.
    kv_fp16_bytes: usize,
}

pub(crate) fn finish_reason(f: Finish) -> &'static str {
    match f {
        Finish::Stop => "stop",
        Finish::Length => "length",
        Finish::Context => "context",
        Finish::TimeLimit => "time_limit",
    }
}

impl From<GenerateOutput> for Result_ {
    fn from(o: GenerateOutput) -> Self {
        Self {
            finish_reason: finish_reason(o.finish),
            text: o.text,
            tokens: o.tokens,
            prompt_tokens: o.prompt_tokens,
            prefill_s: o.prefill_s,
            decode_s: o.decode_s,
            kv_resident_bytes: o.kv_resident_bytes,
            kv_fp16_bytes: o.kv_fp16_bytes,
        }
    }
}

#[pymethods]
impl Result_ {
    /// Generated tokens per second of decode.
    #[getter]
    fn decode_tok_s(&self) -> f64 {
        self.tokens.len().saturating_sub(1) as f64 / self.decode_s
    }

    fn __repr__(&self) -> String {
        format!(
            "veloq.Result(tokens={}, finish_reason={:?}, prompt_tokens={}, kv_resident_bytes={})",
            self.tokens.len(),
            self.finish_reason,
            self.prompt_tokens,
            self.kv_resident_bytes
        )
    }
}

/// A generation in progress: iterate it for the text's pieces; `result` once it is done.
#[pyclass(module = "veloq", frozen)]
pub struct Generation {
    model: Py<Model>,
    state: Mutex<GenState>,
}

struct GenState {
    caches: ModelCache,
    decoding: Decoding,
    result: Option<Result_>,
}

impl Generation {
    fn start(py: Python<'_>, model: Py<Model>, ids: &[u32], opts: &GenerateOptions) -> PyResult<Self> {
        let m = model.get();
        let (runner, cache) = (&*m.runner, &m.cache);
        let (caches, decoding) = py
            .detach(|| -> veloq_candle::Result<_> {
                let mut caches = cache.build(runner.model())?;
                let decoding = Decoding::start(runner, &mut caches, ids, opts, &mut |_, _| {})?;
                Ok((caches, decoding))
            })
            .py()?;
        Ok(Self { model, state: Mutex::new(GenState { caches, decoding, result: None }) })
    }

    fn lock(&self) -> MutexGuard<'_, GenState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The next non-empty piece of text, or `None` at the end (when `result` is set).
    fn next_piece(&self, py: Python<'_>) -> PyResult<Option<String>> {
        let m = self.model.get();
        let mut guard = self.lock();
        let s = &mut *guard;
        if s.result.is_some() {
            return Ok(None);
        }
        let (runner, tok) = (&*m.runner, &*m.tokenizer);
        let piece = py
            .detach(|| -> veloq_candle::Result<Option<String>> {
                loop {
                    match s.decoding.step(runner, tok, &mut s.caches)? {
                        Some(p) if p.is_empty() => continue,
                        other => return Ok(other),
                    }
                }
            })
            .py()?;
        if piece.is_none() {
            s.result = Some(s.decoding.output(runner, tok, &s.caches).py()?.into());
        }
        Ok(piece)
    }
}

#[pymethods]
impl Generation {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<String> {
        self.next_piece(py)?.ok_or_else(|| PyStopIteration::new_err(()))
    }

    /// The finished generation's result (`None` until the iterator is exhausted).
    #[getter]
    fn result(&self) -> Option<Result_> {
        self.lock().result.clone()
    }

    /// Tokens generated so far.
    #[getter]
    fn tokens(&self) -> Vec<u32> {
        self.lock().decoding.tokens().to_vec()
    }
}

/// A conversation with a model: `say` adds a user turn and returns the reply.
#[pyclass(module = "veloq", frozen)]
pub struct Chat {
    model: Py<Model>,
    /// Taken out for a turn (a Rust chat borrows the model) and always put back.
    state: Mutex<Option<Conversation>>,
}

impl Chat {
    /// Runs `f` on the conversation resumed over its model, and puts it back whatever happens.
    fn with<T>(&self, f: impl FnOnce(&mut RustChat<'_>) -> T) -> T {
        let m = self.model.get();
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let c = s.take().expect("a chat's conversation is always put back");
        let mut chat = RustChat::resume(&*m.runner, &m.tokenizer, c);
        let out = f(&mut chat);
        *s = Some(chat.into_conversation());
        out
    }
}

#[pymethods]
impl Chat {
    /// Adds the user's turn and generates the reply; `on_text(piece)` is called as text comes.
    /// A turn that fails (past the context, a bad setting) leaves the conversation as it was.
    /// Sampling keywords as `generate` takes them (256 tokens by default).
    #[pyo3(signature = (message, *, on_text = None, **sampling))]
    fn say(
        &self,
        py: Python<'_>,
        message: &str,
        on_text: Option<Py<PyAny>>,
        sampling: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Result_> {
        let opts = options(sampling, 256)?;
        let mut callback_error = None;
        let out = py.detach(|| {
            self.with(|chat| {
                chat.say(message, &opts, &mut |e| {
                    if let (Event::Text(t), Some(f), None) = (e, &on_text, &callback_error) {
                        if let Err(err) = Python::attach(|py| f.call1(py, (t,))) {
                            callback_error = Some(err);
                        }
                    }
                })
            })
        });
        if let Some(err) = callback_error {
            return Err(err);
        }
        Ok(out.py()?.into())
    }

    /// Forgets the conversation (frees the caches' positions).
    fn reset(&self) -> PyResult<()> {
        self.with(|chat| chat.reset()).py()
    }

    /// Every token of the conversation so far.
    #[getter]
    fn history(&self) -> Vec<u32> {
        self.with(|chat| chat.history().to_vec())
    }

    /// Bytes the conversation's caches hold.
    #[getter]
    fn kv_resident_bytes(&self) -> usize {
        self.with(|chat| chat.caches().resident_bytes())
    }
}
