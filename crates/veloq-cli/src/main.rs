//! The `veloq` command-line tool.

use anyhow::Result;
use clap::{Parser, Subcommand};

mod bench;
mod calibrate;
mod chat;
mod device;
mod eval;
mod generate;
mod needle;
mod plot;
mod serve;
mod synthetic;

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
    /// Generate text with a compressed (or fp16) KV cache.
    Generate(generate::Args),
    /// Chat with the model: multi-turn, the history kept in the (compressed) caches.
    Chat(chat::Args),
    /// Calibrate VecInfer codebooks on the model's own keys and values over real text.
    Calibrate(calibrate::Args),
    /// Quality on real text: perplexity, KL and top-1 agreement vs fp16 for every method.
    Eval(eval::Args),
    /// An OpenAI-compatible server: continuous batching inside a KV memory budget.
    Serve(serve::Args),
    /// Benchmarks, measured side by side in one run.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Bench(b) => bench::run(b),
        Command::Generate(a) => generate::run(a),
        Command::Chat(a) => chat::run(a),
        Command::Calibrate(a) => calibrate::run(a),
        Command::Eval(a) => eval::run(a),
        Command::Serve(a) => serve::run(a),
    }
}
