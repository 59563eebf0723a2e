//! One error type for the codec crate: every variant names exactly what was wrong, so a caller can
//! print it to a user without adding context.

use std::path::PathBuf;

/// Errors from codec construction, encoding and artifact I/O.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A shape or size that does not fit what the operation needs.
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// A configuration value outside the supported range.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// Input data containing NaN or infinity where finite values are required.
    #[error("non-finite value in {what} at index {index}: {value}")]
    /// A NaN or infinity where finite numbers are required.
    NonFinite {
        /// Which input.
        what: String,
        /// The first bad element.
        index: usize,
        /// Its value.
        value: f32,
    },
    /// An artifact that cannot be read or does not match what the caller expects.
    #[error("calibration artifact {path}: {reason}")]
    /// A calibration file that cannot be used.
    Artifact {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A GPU that is missing, refused a call, or cannot run this configuration.
    #[error("GPU: {0}")]
    Device(String),
    /// The GPU ran out of memory.
    #[error("GPU out of memory: {0}")]
    OutOfMemory(String),
    #[error("I/O on {path}: {source}")]
    /// A file that could not be read or written.
    Io {
        /// The file.
        path: PathBuf,
        #[source]
        /// Why.
        source: std::io::Error,
    },
}

/// Results of the codec crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Fails with [`Error::NonFinite`] at the first NaN or infinity in `data`.
pub fn check_finite(what: &str, data: &[f32]) -> Result<()> {
    match data.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(index) => Err(Error::NonFinite { what: what.to_string(), index, value: data[index] }),
    }
}
