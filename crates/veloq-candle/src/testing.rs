//! Helpers for the unit tests.

/// A seed that differs between runs (tests print it on failure).
pub fn fresh_seed() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
}
