//! Helpers shared by the integration tests (each test crate takes what it uses).
#![allow(dead_code)]

pub mod lockstep;
pub mod shadow;
pub mod shadow_cache;
