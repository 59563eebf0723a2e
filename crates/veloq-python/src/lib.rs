//! veloq for Python: the `veloq._native` extension module, which the pure-Python package `veloq`
//! (python/veloq) re-exports. It stands on the library's typed front door — method names, devices
//! and kernel switches parse exactly as the CLI and the server parse them — and maps the
//! library's errors to exception classes.

mod arrays;
mod calibrate;
mod calibration;
mod errors;
mod kv_cache;
mod model;
mod serve;

use std::path::PathBuf;

use pyo3::prelude::*;

/// Where calibrations are looked for and written unless a call says otherwise: `$VELOQ_CACHE`,
/// else `~/.cache/veloq` — the CLI's `--cache-dir` default, read here at the binding's edge.
pub(crate) fn cache_dir() -> PathBuf {
    std::env::var_os("VELOQ_CACHE").map(PathBuf::from).unwrap_or_else(veloq::paths::default_cache_dir)
}

/// The method names veloq knows, with a line each: what is stored, at how many bits (head_dim 64).
#[pyfunction]
#[pyo3(signature = (head_dim = 64))]
fn methods(head_dim: usize) -> Vec<(String, String)> {
    veloq_candle::Method::catalogue().into_iter().map(|m| (m.to_string(), m.describe(head_dim))).collect()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    m.add_class::<model::Model>()?;
    m.add_class::<model::Generation>()?;
    m.add_class::<model::Chat>()?;
    m.add_class::<model::Result_>()?;
    m.add_class::<calibration::Calibration>()?;
    m.add_class::<kv_cache::KvCache>()?;
    m.add_class::<serve::Server>()?;
    m.add_function(wrap_pyfunction!(serve::serve, m)?)?;
    m.add_function(wrap_pyfunction!(calibrate::calibrate, m)?)?;
    m.add_function(wrap_pyfunction!(methods, m)?)?;
    Ok(())
}
