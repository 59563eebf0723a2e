//! `veloq.calibrate`: the codebooks of a VecInfer method trained on the model's own keys and
//! values over real text; the same artifact `veloq calibrate` writes, in the same place.

use std::path::PathBuf;

use pyo3::prelude::*;

use veloq::calibrate::ValueWeights;
use veloq_candle::collect::{calibrate_text, CalibrateOptions, Progress};
use veloq_candle::model::Model;
use veloq_candle::runtime::calibration_path;
use veloq_candle::Method;

use crate::errors::{ConfigError, IntoPy, MethodError};
use crate::model::parse_method;

/// Calibrates `method` for the GGUF model at `model` on `text` (a string, or the path of a text
/// file) and writes the artifact to `out` (default: where `Model.open` looks for it). Returns the
/// path written. `value_weights` is what the value codebooks' k-means weighs rows by: "uniform" or
/// "attention" (`veloq calibrate --value-weights`). `progress(stage, done, total)` is called as it goes ("collecting" tokens, then
/// "training" layers).
#[pyfunction]
#[pyo3(signature = (model, text, *, method = "vq-4", tokens = 8192, window = 8192, seed = 0, value_weights = "uniform", out = None, progress = None))]
#[allow(clippy::too_many_arguments)]
pub fn calibrate(
    py: Python<'_>,
    model: PathBuf,
    text: &Bound<'_, PyAny>,
    method: &str,
    tokens: usize,
    window: usize,
    seed: u64,
    value_weights: &str,
    out: Option<PathBuf>,
    progress: Option<Py<PyAny>>,
) -> PyResult<PathBuf> {
    let m = parse_method(method)?;
    let value_weights: ValueWeights =
        value_weights.parse().map_err(|e: veloq::Error| ConfigError::new_err(e.to_string()))?;
    let Method::VecInfer(vq) = m else {
        return Err(MethodError::new_err(format!(
            "{m} needs no calibration: only VecInfer methods (vq-…) have codebooks"
        )));
    };
    let text: String = match text.extract::<PathBuf>() {
        Ok(p) if !text.is_instance_of::<pyo3::types::PyString>() => {
            std::fs::read_to_string(&p).map_err(|e| ConfigError::new_err(format!("reading {}: {e}", p.display())))?
        }
        _ => text.extract()?,
    };
    let opts = CalibrateOptions { tokens, window, seed, value_weights };
    let out = out.unwrap_or_else(|| calibration_path(&crate::cache_dir(), &model, &m));
    let mut callback_error = None;
    let cal = py
        .detach(|| {
            let (gguf, tok) = Model::open(&model, window.max(512))?;
            calibrate_text(&gguf, &tok, &text, vq, &opts, &mut |p| {
                let (stage, done, total) = match p {
                    Progress::Collecting(d, t) => ("collecting", d, t),
                    Progress::Training(d, t) => ("training", d, t),
                };
                if let (Some(f), None) = (&progress, &callback_error) {
                    if let Err(e) = Python::attach(|py| f.call1(py, (stage, done, total))) {
                        callback_error = Some(e);
                    }
                }
            })
        })
        .py()?;
    if let Some(e) = callback_error {
        return Err(e);
    }
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir).map_err(|e| ConfigError::new_err(format!("creating {}: {e}", dir.display())))?;
    }
    cal.save(&out).py()?;
    Ok(out)
}
