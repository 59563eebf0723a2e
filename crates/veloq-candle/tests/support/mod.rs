//! Helpers shared by the integration tests (each test crate takes what it uses).
#![allow(dead_code)]

pub mod fixture;
pub mod lockstep;
pub mod shadow;
pub mod shadow_cache;

use std::path::PathBuf;

/// Where `scripts/fetch-data` put the real model and texts: `$VELOQ_CACHE`, else the library's
/// default (tests are the edge that reads the variable, as binaries are).
pub fn cache_dir() -> PathBuf {
    std::env::var_os("VELOQ_CACHE").map(PathBuf::from).unwrap_or_else(veloq::paths::default_cache_dir)
}
