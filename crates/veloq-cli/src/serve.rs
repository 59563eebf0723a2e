//! `veloq serve`: flags in, [`veloq_server`] out.

use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args as ClapArgs;

use veloq_candle::engine::{EngineConfig, Reserve};
use veloq_candle::units::{human_bytes as human, parse_bytes};
use veloq_server::{Guards, ServeOptions, Server, Serving};

use crate::args::Run;

/// `veloq serve`'s flags.
#[derive(ClapArgs)]
pub struct Args {
    #[command(flatten)]
    /// Model and caches.
    pub run: Run,
    /// KV cache memory for all sequences together (shared tables included): 2GiB, 512MiB, 1.5GB…
    #[arg(long, default_value = "2GiB", value_parser = size)]
    pub kv_budget: usize,
    #[arg(long, default_value = "127.0.0.1")]
    /// Interface to listen on.
    pub host: String,
    /// 0 picks a free port (the address is printed).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Sequences at once, at most (GPU caches reserve each slot's context: there the budget may
    /// allow fewer).
    #[arg(long, default_value_t = 64)]
    pub max_seqs: usize,
    /// Tokens per forward pass: every running sequence's next token, then prompt chunks.
    #[arg(long, default_value_t = veloq_candle::prefill::DEFAULT_CHUNK)]
    pub step_tokens: usize,
    /// No prefix sharing: free a finished conversation's cache at once instead of keeping it
    /// resident for a request that starts with it (its next turn, the same system prompt), and
    /// feed every request's whole prompt instead of copying what a running one holds (`n`
    /// choices, a shared system prompt).
    #[arg(long)]
    pub no_prefix_cache: bool,
    /// What admission reserves per request: `auto` (a request that names max_tokens, its worst
    /// case; a chat that names none, its prompt and 256 positions, then storage as it grows),
    /// `worst-case` (prompt + max_tokens up front, never preempted) or `grow` (the prompt, then
    /// storage as it grows). When memory runs short the newest growing sequence is preempted and
    /// resumed later, exactly where it stopped.
    #[arg(long, default_value_t = Reserve::Auto)]
    pub reserve: Reserve,
    /// Chat completions without max_tokens generate at most this many (default: the rest of the
    /// context, as OpenAI does).
    #[arg(long)]
    pub default_max_tokens: Option<usize>,
    /// Seconds a request may take, queued and running; then it ends with what it has generated
    /// (finish_reason "length"). Default: no limit.
    #[arg(long, value_parser = seconds)]
    pub request_timeout: Option<f64>,
    /// The model id clients use (default: the GGUF file's name without extension).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Largest request body.
    #[arg(long, default_value = "4MiB", value_parser = size)]
    pub max_body: usize,
    /// Seconds a connection may take to send a request's headers (or stay idle before its first).
    #[arg(long, default_value_t = 30)]
    pub header_timeout: u64,
    /// Open connections at most; more are closed on arrival.
    #[arg(long, default_value_t = 8192)]
    pub max_connections: usize,
    /// No line per finished request on stderr.
    #[arg(long)]
    pub quiet: bool,
    /// Require `Authorization: Bearer <key>` on /v1/* (repeat for several keys; default: the
    /// VELOQ_API_KEY environment variable when set).
    #[arg(long, env = "VELOQ_API_KEY", value_delimiter = ',')]
    pub api_key: Vec<String>,
    /// Origins whose browsers may call the API, `*` for any (repeatable); preflights are answered.
    #[arg(long, value_delimiter = ',')]
    pub cors_origin: Vec<String>,
    /// Requests waiting for admission at most; more get 429 with Retry-After (default: no bound).
    #[arg(long)]
    pub max_queued: Option<usize>,
    /// Seconds running requests may take to finish after Ctrl-C / SIGTERM (new ones get 503).
    #[arg(long, default_value_t = 30)]
    pub shutdown_grace: u64,
}

impl Args {
    /// The engine's settings these flags give.
    pub fn engine(&self) -> EngineConfig {
        EngineConfig {
            kv_budget: self.kv_budget,
            max_seqs: self.max_seqs,
            step_tokens: self.step_tokens,
            prefix_cache: !self.no_prefix_cache,
            reserve: self.reserve,
        }
    }

    /// The server's options these flags give.
    pub fn options(&self) -> ServeOptions {
        ServeOptions {
            host: self.host.clone(),
            port: self.port,
            default_max_tokens: self.default_max_tokens,
            request_timeout: self.request_timeout.map(Duration::from_secs_f64),
            max_body: self.max_body,
            header_timeout: Duration::from_secs(self.header_timeout),
            max_connections: self.max_connections,
            log: !self.quiet,
            stop_on_ctrl_c: true,
            guards: Guards {
                api_keys: self.api_key.clone(),
                cors_origins: self.cors_origin.clone(),
                max_queued: self.max_queued,
            },
            shutdown_grace: Duration::from_secs(self.shutdown_grace),
        }
    }
}

/// A size flag (`2GiB`…).
pub fn size(s: &str) -> std::result::Result<usize, String> {
    parse_bytes(s).map_err(|e| e.to_string())
}

/// A positive number of seconds.
fn seconds(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err(format!("{s:?} is not a positive number of seconds")),
    }
}

/// Loads the model, starts the server and serves until Ctrl-C.
pub fn run(a: Args) -> Result<()> {
    let started = std::time::Instant::now();
    let loaded = a.run.load()?;
    let name = a.served_model_name.clone().unwrap_or_else(|| {
        let p = a.run.files.model();
        p.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into())
    });
    let mut serving = Serving::new(loaded, &name);
    serving.engine = a.engine();
    let method = serving.cache.name();
    let options = a.options();
    let server = Server::start(serving, &options).context("starting the server")?;
    let info = server.info();
    eprintln!(
        "veloq serve: {name} with the {method} cache on {}; KV budget {} ({} shared tables), up to {} sequences of {} positions, {:.0} B per position; open files {}; ready in {:.1} s",
        a.run.device,
        human(info.kv_budget),
        human(info.shared_bytes),
        info.slots,
        info.max_context,
        info.bytes_per_position,
        server.open_files(),
        started.elapsed().as_secs_f64(),
    );
    eprintln!("listening on http://{}", server.addr());
    server.wait()?;
    eprintln!("veloq serve: stopped");
    Ok(())
}
