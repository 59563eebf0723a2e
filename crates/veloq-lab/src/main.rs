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

impl Command {
    /// The directory the command reads models and compiled kernels from (`--cache-dir`), or, for
    /// benchmarks of random-weight models that take none, the one `--cache-dir` defaults to.
    fn cache_dir(&self) -> std::path::PathBuf {
        let given = match self {
            Command::Serve(a) => Some(&a.run.files.cache_dir),
            Command::Eval(a) => Some(match &a.mode {
                Some(eval_cmd::EvalMode::Needle(n)) => &n.files.cache_dir,
                None => &a.files.cache_dir,
            }),
            Command::Bench(b) => b.cache_dir(),
        };
        given.cloned().unwrap_or_else(|| {
            std::env::var_os("VELOQ_CACHE").map(Into::into).unwrap_or_else(veloq::paths::default_cache_dir)
        })
    }
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    veloq_cli::args::place_driver_cache(&cli.command.cache_dir());
    if let Some(f) = cli.font {
        veloq_lab::plot::use_font(f);
    }
    match cli.command {
        Command::Eval(a) => eval_cmd::run(a),
        Command::Bench(b) => bench::run(b),
        Command::Serve(a) => serve_cmd::run(a),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn cache_dir_of(args: &[&str]) -> PathBuf {
        let cli = Cli::try_parse_from(std::iter::once("veloq-lab").chain(args.iter().copied())).unwrap();
        cli.command.cache_dir()
    }

    /// The CUDA driver's cache goes under the directory the command was given, whichever command.
    #[test]
    fn every_command_that_takes_a_cache_dir_places_the_driver_cache_there() {
        assert_eq!(cache_dir_of(&["eval", "--cache-dir", "/m/a"]), PathBuf::from("/m/a"));
        assert_eq!(cache_dir_of(&["eval", "needle", "--cache-dir", "/m/b"]), PathBuf::from("/m/b"));
        assert_eq!(cache_dir_of(&["bench", "decode", "--cache-dir", "/m/c"]), PathBuf::from("/m/c"));
        assert_eq!(cache_dir_of(&["bench", "prefill", "--cache-dir", "/m/d"]), PathBuf::from("/m/d"));
        assert_eq!(cache_dir_of(&["bench", "serve", "--cache-dir", "/m/e"]), PathBuf::from("/m/e"));
        assert_eq!(cache_dir_of(&["serve", "--cache-dir", "/m/f"]), PathBuf::from("/m/f"));
    }

    #[test]
    fn commands_without_one_take_the_default() {
        let default = std::env::var_os("VELOQ_CACHE").map(Into::into).unwrap_or_else(veloq::paths::default_cache_dir);
        assert_eq!(cache_dir_of(&["bench", "search"]), default);
        assert_eq!(cache_dir_of(&["eval"]), default);
    }
}
