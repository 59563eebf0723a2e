//! Codec math: everything about turning head vectors into codes and back, with no ML framework.

pub mod block;
pub mod codebook;
pub mod hadamard;
pub mod kivi;
pub mod lloyd_max;
pub mod pack;
pub mod search;
pub mod smooth;
pub mod transform;
pub mod vecinfer;
