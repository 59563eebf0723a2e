//! The `veloq` command-line tool: generate, chat, calibrate, serve. Benchmarks and evaluations
//! are the lab's (`veloq-lab`).

use anyhow::Result;
use clap::{Parser, Subcommand};

use veloq_candle::Method;
use veloq_cli::{calibrate, chat, generate, serve};

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
    /// An OpenAI-compatible server: continuous batching inside a KV memory budget.
    Serve(serve::Args),
    /// The cache methods, with what they store and their bits per element.
    Methods,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let cache_dir = match &cli.command {
        Command::Generate(a) => Some(&a.run.files.cache_dir),
        Command::Chat(a) => Some(&a.run.files.cache_dir),
        Command::Serve(a) => Some(&a.run.files.cache_dir),
        Command::Calibrate(a) => Some(&a.files.cache_dir),
        Command::Methods => None,
    };
    if let Some(dir) = cache_dir {
        veloq_cli::args::place_driver_cache(dir);
    }
    match cli.command {
        Command::Generate(a) => generate::run(a),
        Command::Chat(a) => chat::run(a),
        Command::Calibrate(a) => calibrate::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Methods => {
            for m in Method::catalogue() {
                println!("{:<20} {}", m.to_string(), m.describe(64));
            }
            println!("(bits per element at head_dim 64; rlm's per-row scale costs 16/head_dim)");
            Ok(())
        }
    }
}
