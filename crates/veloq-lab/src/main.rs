//! `veloq-lab`: benchmarks measured side by side in one run, the quality harnesses, and the
//! figures; beside the product (`veloq`), never inside it.

use anyhow::Result;
use clap::{Parser, Subcommand};

mod bench;
mod candidate_args;
mod eval_cmd;
mod needle_cmd;
mod serve_cmd;

// Benchmarks report the heap they use: every allocation of this binary is counted (the product
// binary pays nothing for it).
#[global_allocator]
static ALLOC: veloq_lab::measure::CountingAlloc = veloq_lab::measure::CountingAlloc;

#[derive(Parser)]
#[command(name = "veloq-lab", version, about = "veloq's benchmarks and evaluations")]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// TrueType font of the figures (default DejaVu Sans from the system).
    #[arg(long, global = true, env = "VELOQ_FONT")]
    font: Option<std::path::PathBuf>,
}

#[derive(Subcommand)]
enum Command {
    /// Quality on real text: perplexity, KL and top-1 agreement vs fp16 for every method
    /// (`eval needle`: passkey retrieval).
    Eval(eval_cmd::Args),
    /// Benchmarks, measured side by side in one run.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// `veloq serve`, plus random-weight models (`--model synthetic:llama8b`): what `bench serve`
    /// starts.
    #[command(hide = true)]
    Serve(serve_cmd::Args),
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    // The served model's cache directory, else the one every other command defaults to.
    let cache_dir = match &cli.command {
        Command::Serve(a) => a.run.files.cache_dir.clone(),
        _ => std::env::var_os("VELOQ_CACHE").map(Into::into).unwrap_or_else(veloq::paths::default_cache_dir),
    };
    veloq_cli::args::place_driver_cache(&cache_dir);
    if let Some(f) = cli.font {
        veloq_lab::plot::use_font(f);
    }
    match cli.command {
        Command::Eval(a) => eval_cmd::run(a),
        Command::Bench(b) => bench::run(b),
        Command::Serve(a) => serve_cmd::run(a),
    }
}
