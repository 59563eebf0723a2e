//! `veloq serve`: an OpenAI-compatible HTTP server over the continuous-batching engine
//! (`veloq_candle::engine`), admitting requests by KV memory.
//!
//! Connections are served by hyper directly (HTTP/1.1, a header-read timeout, a cap on open
//! connections, the open-file limit raised at start) so that idle or stalled clients by the
//! thousand cost a little memory and never the server; axum routes the requests.

mod api;
mod metrics;
mod routes;

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args as ClapArgs;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::sync::Semaphore;

use veloq_candle::engine::{Engine, EngineConfig};

use crate::generate::{human, Runtime};
use routes::App;

#[derive(ClapArgs)]
pub struct Args {
    #[command(flatten)]
    pub runtime: Runtime,
    /// KV cache memory for all sequences together (shared tables included): 2GiB, 512MiB, 1.5GB…
    #[arg(long, default_value = "2GiB", value_parser = parse_bytes)]
    pub kv_budget: usize,
    #[arg(long, default_value = "127.0.0.1")]
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
    /// Chat completions without max_tokens generate at most this many (default: the rest of the
    /// context, as OpenAI does; the worst case is what admission reserves).
    #[arg(long)]
    pub default_max_tokens: Option<usize>,
    /// The model id clients use (default: the GGUF file's name without extension).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Largest request body.
    #[arg(long, default_value = "4MiB", value_parser = parse_bytes)]
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
}

/// `2GiB`, `512MiB`, `1.5GB`, `64k`, `1000` (bytes).
pub fn parse_bytes(s: &str) -> std::result::Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("{s:?} is not a size (e.g. 2GiB, 512MiB, 1.5GB)"))?;
    let scale = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        other => return Err(format!("{s:?}: unknown unit {other:?} (B, KB, MB, GB, KiB, MiB, GiB)")),
    };
    let bytes = n * scale;
    if !bytes.is_finite() || bytes < 1.0 || bytes > usize::MAX as f64 {
        return Err(format!("{s:?} is not a usable size"));
    }
    Ok(bytes as usize)
}

pub fn run(a: Args) -> Result<()> {
    let started = std::time::Instant::now();
    let l = a.runtime.load()?;
    let name = a.served_model_name.clone().unwrap_or_else(|| {
        let p = a.runtime.files.model();
        p.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into())
    });
    let (model, tok) = (Arc::new(l.model), Arc::new(l.tok));
    let cfg = EngineConfig { kv_budget: a.kv_budget, max_seqs: a.max_seqs, step_tokens: a.step_tokens };
    let engine = Engine::start(model.clone(), tok.clone(), l.config.clone(), cfg).context("starting the engine")?;
    let info = engine.info().clone();
    let app = Arc::new(App {
        engine,
        model,
        tok,
        name: name.clone(),
        created: routes::unix_now(),
        default_max_tokens: a.default_max_tokens,
        next_id: AtomicU64::new(0),
        log: !a.quiet,
    });
    let files = raise_open_files();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind((a.host.as_str(), a.port))
            .await
            .with_context(|| format!("binding {}:{}", a.host, a.port))?;
        let addr: SocketAddr = listener.local_addr()?;
        eprintln!(
            "veloq serve: {name} with the {} cache on {}; KV budget {} ({} shared tables), up to {} sequences of {} positions, {:.0} B per position; open files {files}; ready in {:.1} s",
            info.method,
            a.runtime.device,
            human(info.kv_budget),
            human(info.shared_bytes),
            info.slots,
            info.max_context,
            info.bytes_per_position,
            started.elapsed().as_secs_f64(),
        );
        eprintln!("listening on http://{addr}");
        let router = routes::router(app, a.max_body);
        let conns = Arc::new(Semaphore::new(a.max_connections));
        let timeout = Duration::from_secs(a.header_timeout.max(1));
        loop {
            let (stream, _) = tokio::select! {
                r = listener.accept() => match r {
                    Ok(c) => c,
                    Err(e) => {
                        // Out of file descriptors and the like: wait for connections to close.
                        eprintln!("accept: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
                _ = tokio::signal::ctrl_c() => break,
            };
            let Ok(permit) = conns.clone().try_acquire_owned() else { continue };
            let _ = stream.set_nodelay(true);
            let svc = TowerToHyperService::new(router.clone());
            tokio::spawn(async move {
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(timeout)
                    .serve_connection(TokioIo::new(stream), svc);
                let _ = conn.await;
                drop(permit);
            });
        }
        eprintln!("veloq serve: stopped");
        Ok::<(), anyhow::Error>(())
    })?;
    Ok(())
}

/// Raises the soft limit on open files to the hard one (every connection is a descriptor);
/// returns the limit in force.
fn raise_open_files() -> u64 {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit only read and write the struct passed by pointer, which lives on
    // this stack frame for both calls.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return 0;
        }
        if lim.rlim_cur < lim.rlim_max {
            let want = libc::rlimit { rlim_cur: lim.rlim_max, rlim_max: lim.rlim_max };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &want) == 0 {
                lim = want;
            }
        }
    }
    lim.rlim_cur
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_bytes("2GiB"), Ok(2 << 30));
        assert_eq!(parse_bytes("512 MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("1.5GB"), Ok(1_500_000_000));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        for bad in ["", "GiB", "2 parsecs", "-1GiB", "0"] {
            assert!(parse_bytes(bad).is_err(), "{bad}");
        }
    }
}
