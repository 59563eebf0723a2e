#![warn(missing_docs)]
//! The `veloq` command line as a library: each command's flags and run function, and the flags
//! they share, for the binary and for the lab's binary (which serves through the same command).

pub mod args;
pub mod calibrate;
pub mod chat;
pub mod generate;
pub mod progress;
pub mod serve;
