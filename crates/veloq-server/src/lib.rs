#![warn(missing_docs)]
//! `veloq serve` as a library: an OpenAI-compatible HTTP server over the continuous-batching
//! engine (`veloq_candle::engine`), admitting requests by KV memory. The engine knows nothing of
//! HTTP; this crate is the wire format (OpenAI's requests, checked field by field, and replies),
//! the routes and server-sent events, and Prometheus metrics.
//!
//! Connections are served by hyper directly (HTTP/1.1, a header-read timeout, a cap on open
//! connections, the open-file limit raised at start) so that idle or stalled clients by the
//! thousand cost a little memory and never the server; axum routes the requests.
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use veloq_candle::runtime::{load, RunOptions};
//! use veloq_server::{Server, ServeOptions, Serving};
//! let run = load("smollm2.gguf".as_ref(), &"fp16".parse()?, None, &RunOptions::default())?;
//! let server = Server::start(Serving::new(run, "smollm2"), &ServeOptions::default())?;
//! println!("listening on http://{}", server.addr());
//! server.wait()?;
//! # Ok(()) }
//! ```

mod api;
mod guard;
mod metrics;
mod routes;

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::sync::{oneshot, Semaphore};

use veloq_candle::engine::{Engine, EngineConfig, EngineInfo};
use veloq_candle::model::Tokenizer;
use veloq_candle::runtime::Loaded;
use veloq_candle::{CacheConfig, Forward};

pub use guard::Guards;
use routes::App;

/// Why the server could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The engine refused its configuration (a budget that holds no sequence, a device error).
    #[error("starting the engine: {0}")]
    Engine(#[from] veloq_candle::Error),
    /// The address could not be bound.
    #[error("binding {addr}: {source}")]
    Bind {
        /// What was asked for.
        addr: String,
        /// Why not.
        source: std::io::Error,
    },
    /// The async runtime or its thread could not start.
    #[error("starting the server's runtime: {0}")]
    Runtime(std::io::Error),
    /// The server's thread ended by a panic.
    #[error("the server's thread panicked")]
    Panicked,
}

/// What a server serves: a model ready to run, its tokenizer, the caches' method and the engine's
/// sharing of the machine.
pub struct Serving {
    /// The model (with CUDA graphs on CUDA).
    pub runner: Arc<dyn Forward>,
    /// Its tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// The caches.
    pub cache: CacheConfig,
    /// Budget, sequences, tokens per step.
    pub engine: EngineConfig,
    /// The id clients name the model by (`/v1/models`).
    pub name: String,
}

impl Serving {
    /// `loaded`'s model under `name`, with the engine's defaults (2 GiB of KV, 64 sequences).
    pub fn new(loaded: Loaded, name: &str) -> Self {
        Self {
            runner: Arc::new(loaded.runner),
            tokenizer: Arc::new(loaded.tokenizer),
            cache: loaded.cache,
            engine: EngineConfig::default(),
            name: name.to_string(),
        }
    }
}

/// How the server meets the network.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServeOptions {
    /// Interface to listen on.
    pub host: String,
    /// Port; 0 picks a free one ([`Server::addr`] tells which).
    pub port: u16,
    /// Chat completions without `max_tokens` generate at most this many (default: the rest of
    /// the context, as OpenAI does; the worst case is what admission reserves).
    pub default_max_tokens: Option<usize>,
    /// Largest request body.
    pub max_body: usize,
    /// Time a connection may take to send a request's headers (or stay idle before its first).
    pub header_timeout: Duration,
    /// Open connections at most; more are closed on arrival.
    pub max_connections: usize,
    /// A line per finished request on stderr.
    pub log: bool,
    /// Stop on Ctrl-C (a binary's choice; an embedding program may handle the signal itself).
    pub stop_on_ctrl_c: bool,
    /// API keys, CORS origins, the bound on waiting requests.
    pub guards: Guards,
    /// At shutdown, how long running requests may take to finish (new ones get a 503 meanwhile).
    pub shutdown_grace: Duration,
}

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8080,
            default_max_tokens: None,
            max_body: 4 << 20,
            header_timeout: Duration::from_secs(30),
            max_connections: 8192,
            log: true,
            stop_on_ctrl_c: true,
            guards: Guards::default(),
            shutdown_grace: Duration::from_secs(30),
        }
    }
}

/// A running server: listening once [`start`](Self::start) returns, until [`stop`](Self::stop),
/// Ctrl-C, or the process ends.
pub struct Server {
    addr: SocketAddr,
    info: EngineInfo,
    open_files: u64,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    /// Starts the engine (builds the caches for the budget) and the HTTP server on its own
    /// threads; returns once the address is bound.
    pub fn start(serving: Serving, options: &ServeOptions) -> Result<Self, Error> {
        let engine = Engine::start(serving.runner.clone(), serving.tokenizer.clone(), serving.cache, serving.engine)?;
        let info = engine.info().clone();
        let app = Arc::new(App {
            engine,
            model: serving.runner,
            tok: serving.tokenizer,
            name: serving.name,
            created: routes::unix_now(),
            default_max_tokens: options.default_max_tokens,
            next_id: AtomicU64::new(0),
            log: options.log,
            guards: options.guards.clone(),
            waiting: Arc::default(),
            active: Arc::default(),
            draining: Default::default(),
        });
        let open_files = raise_open_files();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(Error::Runtime)?;
        let bind = format!("{}:{}", options.host, options.port);
        let listener = rt
            .block_on(tokio::net::TcpListener::bind((options.host.as_str(), options.port)))
            .map_err(|source| Error::Bind { addr: bind.clone(), source })?;
        let addr = listener.local_addr().map_err(|source| Error::Bind { addr: bind, source })?;
        let (stop, stopped) = oneshot::channel();
        let router = routes::router(app.clone(), options.max_body);
        let grace = options.shutdown_grace;
        let (limit, timeout) = (options.max_connections, options.header_timeout.max(Duration::from_secs(1)));
        let ctrl_c = options.stop_on_ctrl_c;
        let thread = std::thread::Builder::new()
            .name("veloq-serve".into())
            .spawn(move || {
                rt.block_on(async {
                    accept(listener, router, limit, timeout, ctrl_c, stopped).await;
                    drain(&app, grace).await;
                })
            })
            .map_err(Error::Runtime)?;
        Ok(Self { addr, info, open_files, stop: Some(stop), thread: Some(thread) })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// What the engine runs with (slots, budget, bytes per position).
    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    /// The open-file limit in force (raised to the hard limit at start).
    pub fn open_files(&self) -> u64 {
        self.open_files
    }

    /// Blocks until the server stops (Ctrl-C).
    pub fn wait(mut self) -> Result<(), Error> {
        self.join()
    }

    /// Stops accepting connections and returns once the server's thread has ended.
    pub fn stop(mut self) -> Result<(), Error> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        self.join()
    }

    fn join(&mut self) -> Result<(), Error> {
        match self.thread.take() {
            Some(t) => t.join().map_err(|_| Error::Panicked),
            None => Ok(()),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = self.join();
    }
}

/// Accepts connections until `stopped` fires (or Ctrl-C when `ctrl_c`), each served by hyper on its own task
/// under a permit of `limit`.
async fn accept(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    limit: usize,
    timeout: Duration,
    ctrl_c: bool,
    mut stopped: oneshot::Receiver<()>,
) {
    let interrupted = async {
        match ctrl_c {
            true => stop_signal().await,
            false => std::future::pending().await,
        }
    };
    tokio::pin!(interrupted);
    let conns = Arc::new(Semaphore::new(limit));
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
            _ = &mut interrupted => break,
            _ = &mut stopped => break,
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
}

/// Ctrl-C, or SIGTERM (what service managers and container runtimes send) on Unix.
async fn stop_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).ok();
        let terminated = async {
            match term.as_mut() {
                Some(t) => {
                    t.recv().await;
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = terminated => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Refuses new requests and waits (up to `grace`) for the running ones to finish.
async fn drain(app: &App, grace: Duration) {
    app.draining.store(true, std::sync::atomic::Ordering::SeqCst);
    let start = std::time::Instant::now();
    let active = || app.active.load(std::sync::atomic::Ordering::SeqCst);
    if active() > 0 && app.log {
        eprintln!("shutting down: finishing {} running requests (up to {} s)", active(), grace.as_secs());
    }
    while active() > 0 && start.elapsed() < grace {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
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
