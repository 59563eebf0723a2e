//! The `veloq` command-line tool.

use anyhow::Result;
use clap::{Parser, Subcommand};

mod bench;

#[global_allocator]
static ALLOC: veloq::measure::CountingAlloc = veloq::measure::CountingAlloc;

#[derive(Parser)]
#[command(name = "veloq", version, about = "Compressed KV caches for LLM inference")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Benchmarks, measured side by side in one run.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Bench(b) => bench::run(b),
    }
}
