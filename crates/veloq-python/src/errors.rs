//! Python exceptions for the library's errors: one class per kind a caller can act on, all under
//! `veloq.VeloqError`, so `except veloq.ContextOverflowError` works without reading messages.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

use veloq_candle::Error;

create_exception!(veloq, VeloqError, PyException, "Base of every error veloq raises.");
create_exception!(
    veloq,
    ModelError,
    VeloqError,
    "A model file that cannot be read, or an architecture veloq does not run."
);
create_exception!(veloq, MethodError, VeloqError, "A method name outside veloq's vocabulary (see veloq.methods()).");
create_exception!(
    veloq,
    CalibrationError,
    VeloqError,
    "A calibration that does not fit the model or the method, or is missing."
);
create_exception!(veloq, DeviceError, VeloqError, "A device that cannot be opened or used as asked.");
create_exception!(
    veloq,
    ContextOverflowError,
    VeloqError,
    "A sequence would pass the context its cache was sized for."
);
create_exception!(
    veloq,
    ShapeError,
    VeloqError,
    "Arrays of the wrong shape for the cache or codec they were given to."
);
create_exception!(
    veloq,
    ConfigError,
    VeloqError,
    "An option or call that does not fit (a bad setting, a token outside the vocabulary)."
);
create_exception!(veloq, OutOfMemoryError, VeloqError, "The device ran out of memory.");

/// The exception for a library error.
pub fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    if e.is_out_of_memory() {
        return OutOfMemoryError::new_err(msg);
    }
    match e {
        Error::Model { .. } | Error::Architecture { .. } | Error::Tokenizer(_) => ModelError::new_err(msg),
        Error::Method(_) => MethodError::new_err(msg),
        Error::CalibrationMismatch(_) | Error::CalibrationOverlap { .. } => CalibrationError::new_err(msg),
        Error::Device(_) | Error::Cuda(_) => DeviceError::new_err(msg),
        Error::ContextOverflow { .. } => ContextOverflowError::new_err(msg),
        Error::Shape(_) | Error::Position { .. } => ShapeError::new_err(msg),
        Error::Config(_) | Error::Token { .. } => ConfigError::new_err(msg),
        Error::Codec(c) => codec_to_py(c),
        _ => VeloqError::new_err(msg),
    }
}

/// The exception for an error of the codec crate.
pub fn codec_to_py(e: veloq::Error) -> PyErr {
    let msg = e.to_string();
    match e {
        veloq::Error::Shape(_) => ShapeError::new_err(msg),
        veloq::Error::Config(_) | veloq::Error::NonFinite { .. } => ConfigError::new_err(msg),
        veloq::Error::Artifact { .. } => CalibrationError::new_err(msg),
        veloq::Error::Device(_) => DeviceError::new_err(msg),
        veloq::Error::OutOfMemory(_) => OutOfMemoryError::new_err(msg),
        _ => VeloqError::new_err(msg),
    }
}

/// `r?` for library results inside a binding.
pub trait IntoPy<T> {
    /// The result with its error as the matching Python exception.
    fn py(self) -> PyResult<T>;
}

impl<T> IntoPy<T> for Result<T, Error> {
    fn py(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}

impl<T> IntoPy<T> for Result<T, veloq::Error> {
    fn py(self) -> PyResult<T> {
        self.map_err(codec_to_py)
    }
}

/// Adds the exception classes to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("VeloqError", py.get_type::<VeloqError>())?;
    m.add("ModelError", py.get_type::<ModelError>())?;
    m.add("MethodError", py.get_type::<MethodError>())?;
    m.add("CalibrationError", py.get_type::<CalibrationError>())?;
    m.add("DeviceError", py.get_type::<DeviceError>())?;
    m.add("ContextOverflowError", py.get_type::<ContextOverflowError>())?;
    m.add("ShapeError", py.get_type::<ShapeError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("OutOfMemoryError", py.get_type::<OutOfMemoryError>())?;
    Ok(())
}
