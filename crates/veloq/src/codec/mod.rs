//! Codec math: everything about turning head vectors into codes and back, with no ML framework.

pub mod codebook;
pub mod hadamard;
pub mod pack;
pub mod smooth;
pub mod transform;
pub mod vecinfer;
