//! Where veloq keeps what it fetches and computes (models, calibrations, compiled kernels) unless
//! told otherwise: `~/.cache/veloq`. Binaries take an override (`--cache-dir`, `VELOQ_CACHE`) at
//! their edge and pass it down; the library reads no variable of its own.

use std::path::PathBuf;

/// `$HOME/.cache/veloq` (the platform's per-user cache convention), or `./.cache/veloq` without a
/// home directory.
pub fn default_cache_dir() -> PathBuf {
    std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(".")).join(".cache/veloq")
}
