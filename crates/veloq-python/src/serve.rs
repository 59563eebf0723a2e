//! `veloq.serve`: the OpenAI-compatible server in this process, on its own threads, over a model
//! already open (its weights shared with the caller's `Model`).

use std::sync::Mutex;

use pyo3::prelude::*;

use veloq_candle::engine::EngineConfig;
use veloq_candle::units::parse_bytes;
use veloq_server::{ServeOptions, Server as RustServer, Serving};

use crate::errors::{ConfigError, VeloqError};
use crate::model::Model;

/// A running server: `url`, `stop()`; a context manager that stops it on exit.
#[pyclass(module = "veloq", frozen)]
pub struct Server {
    inner: Mutex<Option<RustServer>>,
    #[pyo3(get)]
    /// `http://host:port` (the port chosen by the system when 0 was asked for).
    url: String,
    #[pyo3(get)]
    /// The name clients send as `model`.
    model: String,
}

/// Bytes from an int or a size string ("512MiB", "2GiB").
fn bytes(v: &Bound<'_, PyAny>) -> PyResult<usize> {
    if let Ok(n) = v.extract::<usize>() {
        return Ok(n);
    }
    let s: String =
        v.extract().map_err(|_| ConfigError::new_err("kv_budget: an int of bytes or a size like \"512MiB\""))?;
    parse_bytes(&s).map_err(|e| ConfigError::new_err(format!("kv_budget: {e}")))
}

/// Starts `veloq serve` for `model` at `host:port` (0: any free port) and returns at once.
/// `kv_budget` bounds the caches' bytes (admission by KV memory), `max_seqs` the sequences decoded
/// together, `reserve` what admission holds per request (`auto`, `worst-case`, `grow`: the CLI's
/// `--reserve`), `prefix_cache` keeps finished conversations resident and lets requests that share a prompt prefix copy it from a running one; `default_max_tokens` caps
/// requests that send none.
#[pyfunction]
#[pyo3(signature = (model, *, host = "127.0.0.1", port = 8080, name = None, kv_budget = None, max_seqs = None, reserve = None, prefix_cache = true, default_max_tokens = None, log = false))]
#[allow(clippy::too_many_arguments)]
pub fn serve(
    py: Python<'_>,
    model: &Bound<'_, Model>,
    host: &str,
    port: u16,
    name: Option<String>,
    kv_budget: Option<Bound<'_, PyAny>>,
    max_seqs: Option<usize>,
    reserve: Option<&str>,
    prefix_cache: bool,
    default_max_tokens: Option<usize>,
    log: bool,
) -> PyResult<Server> {
    let m = model.get();
    let mut engine = EngineConfig { prefix_cache, ..EngineConfig::default() };
    if let Some(r) = reserve {
        engine.reserve = r.parse().map_err(|e: String| ConfigError::new_err(format!("reserve: {e}")))?;
    }
    if let Some(b) = kv_budget {
        engine.kv_budget = bytes(&b)?;
    }
    if let Some(n) = max_seqs {
        if n == 0 {
            return Err(ConfigError::new_err("max_seqs must be at least 1"));
        }
        engine.max_seqs = n;
    }
    let name = name.unwrap_or_else(|| {
        m.path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "veloq".into())
    });
    let serving = Serving {
        runner: m.runner.clone(),
        tokenizer: m.tokenizer.clone(),
        cache: m.cache.clone(),
        engine,
        name: name.clone(),
    };
    let options = ServeOptions {
        host: host.to_string(),
        port,
        default_max_tokens,
        log,
        stop_on_ctrl_c: false,
        ..ServeOptions::default()
    };
    let server = py.detach(|| RustServer::start(serving, &options)).map_err(|e| VeloqError::new_err(e.to_string()))?;
    let url = format!("http://{}", server.addr());
    Ok(Server { inner: Mutex::new(Some(server)), url, model: name })
}

#[pymethods]
impl Server {
    /// Stops accepting connections, lets requests in flight finish, and returns when it is down.
    fn stop(&self, py: Python<'_>) -> PyResult<()> {
        let server = self.inner.lock().unwrap_or_else(|p| p.into_inner()).take();
        match server {
            Some(s) => py.detach(|| s.stop()).map_err(|e| VeloqError::new_err(e.to_string())),
            None => Ok(()),
        }
    }

    /// Whether it is still serving.
    #[getter]
    fn running(&self) -> bool {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).is_some()
    }

    fn __enter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        self.stop(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!("veloq.Server(url={:?}, model={:?}, running={})", self.url, self.model, self.running())
    }
}
