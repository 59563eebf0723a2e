//! Serving under load, side by side in one run: `veloq serve` with each cache (fp16, VecInfer
//! calibrations) and, when given, llama.cpp's `llama-server` with f16 and q4_0 KV, every server
//! held to the same KV memory budget and driven by the same clients.
//!
//! Two loads per server, each on a fresh process:
//! - **capacity**: requests whose worst case is a 4k context (a short prompt, `max_tokens` to
//!   4,096 positions) all at once; each client reads a few tokens and leaves. The peak of
//!   concurrently running sequences is how many 4k-context conversations the budget serves.
//! - **throughput**: for each concurrency N, N clients at once, prompts mixing short ones with
//!   4k-token ones (real text, different places per request, as token ids so every server sees the
//!   same tokens), a fixed number of tokens each (`ignore_eos`): aggregate generated tok/s, time to
//!   first token and inter-token latency (p50/p99), peak concurrent sequences, the server's peak RSS,
//!   and the load's physical estimate (`roofline`): what fraction of this device's bound it reached.
//!   A warm-up of the first level's requests (a few tokens each, not counted) runs first, so no
//!   server's first level pays for its process's kernel loading and graph captures.
//! - **conversations** (`--turns`): clients each holding a conversation, every turn's prompt the
//!   whole history again plus a new message, as chat clients send it; veloq with its prefix cache
//!   and without (`--no-prefix-cache`), llama-server with its `cache_prompt` on: time to first token
//!   per turn and the prompt tokens each server actually fed.
//!
//! The clients speak raw HTTP/1.1 and read the server-sent events as they arrive.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args as ClapArgs;
use serde_json::{json, Value};

use veloq_candle::engine::Reserve;
use veloq_candle::model::{encode, load_tokenizer, Weights};

use super::roofline::{self, Cost, Rates};
use super::write_json;
use veloq_candle::runtime::{CudaOptions, Device};
use veloq_candle::units::human_bytes as human;
use veloq_candle::Method;
use veloq_cli::args::Files as ModelFiles;

#[derive(ClapArgs)]
pub struct Args {
    #[command(flatten)]
    pub(crate) files: ModelFiles,
    /// KV memory every server gets (veloq's --kv-budget; llama-server's context sized to it).
    #[arg(long, default_value = "256MiB", value_parser = veloq_cli::serve::size)]
    kv_budget: usize,
    /// veloq caches served side by side, comma separated (VecInfer ones read their default
    /// calibration files; a synthetic model gets random codebooks of the method's shape).
    #[arg(long, value_delimiter = ',', default_value = "fp16,vq-4")]
    methods: Vec<Method>,
    /// Concurrent clients of the throughput load.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    concurrency: Vec<usize>,
    /// Prompt lengths, cycled over the requests of a level (the first request of every level
    /// takes the first).
    #[arg(long, value_delimiter = ',', default_value = "4032,256,512,128,1024,256,128,512")]
    prompts: Vec<usize>,
    /// Requests per level: at least this many, and one per client.
    #[arg(long, default_value_t = 4)]
    min_requests: usize,
    /// Tokens every request generates.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Context of the capacity load's requests (prompt + max_tokens).
    #[arg(long, default_value_t = 4096)]
    capacity_context: usize,
    /// Requests of the capacity load, sent at once.
    #[arg(long, default_value_t = 48)]
    capacity_requests: usize,
    /// Only the capacity load (no throughput levels).
    #[arg(long)]
    capacity_only: bool,
    /// Measure every throughput level from a cold process (no warm-up load first).
    #[arg(long)]
    no_warmup: bool,
    /// Turns of the conversation load (0: none): each turn resends the history and a new message.
    #[arg(long, default_value_t = 0)]
    turns: usize,
    /// Conversations running at once in the conversation load.
    #[arg(long, default_value_t = 4)]
    conversations: usize,
    /// Tokens of a conversation's first prompt (a system prompt and document, say).
    #[arg(long, default_value_t = 1024)]
    first_prompt: usize,
    /// Tokens each later turn adds to the history.
    #[arg(long, default_value_t = 256)]
    turn_tokens: usize,
    /// Only the conversation load.
    #[arg(long)]
    conversations_only: bool,
    /// Throughput requests ask for the rest of the context (as a chat without max_tokens does)
    /// and their clients leave after --max-tokens tokens, as if the model had stopped there.
    #[arg(long)]
    open_ended: bool,
    /// veloq's admission reservations, each served side by side (worst-case, grow).
    #[arg(long, value_delimiter = ',', default_value = "worst-case")]
    reserve: Vec<Reserve>,
    /// What veloq's servers multiply the GGUF's quantized weights as, each served side by side
    /// (stored, f16, f32: `veloq serve --weights`).
    #[arg(long, value_delimiter = ',', default_value = "stored")]
    weights: Vec<Weights>,
    /// Tokens per forward pass of veloq's servers (`veloq serve --step-tokens`: every running
    /// sequence's token, then prompt chunks), each served side by side.
    #[arg(long, value_delimiter = ',', default_values_t = [veloq_candle::prefill::DEFAULT_CHUNK])]
    step_tokens: Vec<usize>,
    /// llama.cpp's llama-server (scripts/llama-cpp builds it beside llama-bench).
    #[arg(long)]
    llama_server: Option<PathBuf>,
    /// Redraw the figure (--plot) from an earlier run's JSON; runs nothing.
    #[arg(long)]
    replot: Option<PathBuf>,
    /// llama-server KV types.
    #[arg(long, value_delimiter = ',', default_value = "f16,q4_0")]
    llama_kv: Vec<String>,
    /// Threads of every server.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Where veloq's servers run (cpu, cuda).
    #[arg(long, default_value = "cpu")]
    device: Device,
    /// Positions per sequence every server is configured for (default: the capacity context;
    /// GPU caches reserve it per slot, llama-server's slots get it each).
    #[arg(long)]
    max_context: Option<usize>,
    #[arg(long)]
    json: Option<PathBuf>,
    #[arg(long)]
    plot: Option<PathBuf>,
}

/// A server configuration under test.
#[derive(Clone, Debug)]
enum Server {
    Veloq {
        label: String,
        method: Method,
        calibration: Option<PathBuf>,
        prefix_cache: bool,
        reserve: Reserve,
        weights: Weights,
        step_tokens: usize,
    },
    Llama {
        kv: String,
        cache_prompt: bool,
    },
}

impl Server {
    fn label(&self) -> String {
        match self {
            Server::Veloq { label, prefix_cache, reserve, weights, step_tokens, .. } => {
                let grow = if *reserve == Reserve::Grow { " grow" } else { "" };
                let prefix = if *prefix_cache { "" } else { " no prefix cache" };
                let weights = if *weights == Weights::Stored { String::new() } else { format!(" {weights} weights") };
                let step = if *step_tokens == veloq_candle::prefill::DEFAULT_CHUNK {
                    String::new()
                } else {
                    format!(" step {step_tokens}")
                };
                format!("veloq {label}{weights}{grow}{prefix}{step}")
            }
            Server::Llama { kv, cache_prompt: false } => format!("llama-server {kv} KV"),
            Server::Llama { kv, cache_prompt: true } => format!("llama-server {kv} KV cache_prompt"),
        }
    }

    /// Cache bytes per stored element: the method's bits, llama.cpp's block sizes.
    fn cache_bytes_per_element(&self, head_dim: usize) -> Result<f64> {
        match self {
            Server::Veloq { method, .. } => Ok(method.bits_per_element(head_dim) / 8.0),
            Server::Llama { kv, .. } => llama_bytes_per_element(kv),
        }
    }

    /// Weight bytes a decode step reads (llama-server multiplies the stored blocks).
    fn weight_bytes(&self, cost: &Cost) -> f64 {
        match self {
            Server::Veloq { weights, .. } => cost.weight_bytes(*weights),
            Server::Llama { .. } => cost.weight_bytes(Weights::Stored),
        }
    }

    /// The same server with prefix reuse on (veloq's prefix cache, llama-server's cache_prompt).
    fn with_prefix_reuse(&self, on: bool) -> Server {
        let mut s = self.clone();
        match &mut s {
            Server::Veloq { prefix_cache, .. } => *prefix_cache = on,
            Server::Llama { cache_prompt, .. } => *cache_prompt = on,
        }
        s
    }
}

/// A running server process.
struct Running {
    child: Child,
    addr: SocketAddr,
    llama: bool,
    log: Arc<Mutex<Vec<String>>>,
    /// llama-server: the KV bytes its context takes (its own log prints the same: `llama_kv_cache:
    /// size = 25.31 MiB` for 4,096 q4_0 positions of SmolLM2 = 4,096 × 6,480 B).
    llama_kv_bytes: Option<u64>,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Running {
    /// The server's peak resident memory so far (kernel high-water mark).
    fn peak_rss(&self) -> Option<u64> {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).ok()?;
        let kib: u64 = s.lines().find(|l| l.starts_with("VmHWM:"))?.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    }
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// llama.cpp's bytes per KV position for SmolLM-like geometry: f16 2 bytes per element, q4_0 18
/// bytes per 32; q8_0 34 per 32.
fn llama_bytes_per_element(kv: &str) -> Result<f64> {
    Ok(match kv {
        "f16" | "bf16" => 2.0,
        "q8_0" => 34.0 / 32.0,
        "q4_0" => 18.0 / 32.0,
        "q4_1" => 20.0 / 32.0,
        "q5_0" => 22.0 / 32.0,
        other => bail!("llama KV type {other}: give f16, q8_0, q5_0, q4_1 or q4_0"),
    })
}

fn start(a: &Args, s: &Server, elements_per_position: usize, parallel: usize) -> Result<Running> {
    let port = free_port()?;
    let max_context = a.max_context.unwrap_or(a.capacity_context);
    let model = a.files.model();
    let mut llama_kv_bytes = None;
    let mut cmd = match s {
        Server::Veloq { method, calibration, prefix_cache, reserve, weights, step_tokens, .. } => {
            let mut c = Command::new(std::env::current_exe()?);
            c.args(["serve", "--quiet", "--method", &method.to_string(), "--port", &port.to_string()])
                .args(["--kv-budget", &a.kv_budget.to_string(), "--max-context", &max_context.to_string()])
                .args(["--max-seqs", &parallel.max(1).to_string(), "--device", &a.device.to_string()])
                .args(["--step-tokens", &step_tokens.to_string()])
                .arg("--cache-dir")
                .arg(&a.files.cache_dir)
                .arg("--model")
                .arg(&model)
                .env("RAYON_NUM_THREADS", a.threads.to_string())
                .env("CANDLE_NUM_THREADS", "1");
            if let Some(cal) = calibration {
                c.arg("--calibration").arg(cal);
            }
            if !prefix_cache {
                c.arg("--no-prefix-cache");
            }
            c.args(["--reserve", &reserve.to_string(), "--weights", &weights.to_string()]);
            c
        }
        Server::Llama { kv, .. } => {
            let bin = a.llama_server.as_ref().context("no --llama-server")?;
            // Its context holds what the budget holds at its bytes per position, split into slots
            // of one capacity context each: every running request is guaranteed its memory, as
            // veloq's admission guarantees each request's worst case.
            let per_position = elements_per_position as f64 * llama_bytes_per_element(kv)?;
            let slots = ((a.kv_budget as f64 / per_position) as usize / max_context).max(1);
            llama_kv_bytes = Some((slots * max_context) as u64 * per_position as u64);
            let mut c = Command::new(bin);
            c.arg("-m")
                .arg(&model)
                .args(["-c", &(slots * max_context).to_string(), "-np", &slots.to_string(), "-no-kvu", "-cram", "0"])
                .args(["-fa", "on", "-ctk", kv, "-ctv", kv, "-t", &a.threads.to_string(), "-ub", "512", "-b", "512"])
                .args(["--host", "127.0.0.1", "--port", &port.to_string(), "--metrics", "--no-webui"]);
            c
        }
    };
    let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().context("starting a server")?;
    let log = Arc::new(Mutex::new(Vec::new()));
    let stderr = child.stderr.take().expect("piped");
    let sink = log.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(|l| l.ok()) {
            sink.lock().expect("log").push(line);
        }
    });
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
    let r = Running { child, addr, llama: matches!(s, Server::Llama { .. }), log, llama_kv_bytes };
    let t = Instant::now();
    loop {
        if let Ok((200, _)) = get(addr, "/health") {
            return Ok(r);
        }
        if t.elapsed() > Duration::from_secs(120) {
            let log = r.log.lock().expect("log").join("\n");
            bail!("{} did not become healthy:\n{log}", s.label());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn get(addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    let status = out.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    Ok((status, out.split_once("\r\n\r\n").map(|x| x.1.to_string()).unwrap_or_default()))
}

/// What one request saw.
#[derive(Clone, Debug, Default)]
struct Trace {
    /// Time to the first text, and the gaps between texts after it (seconds).
    ttft: Option<f64>,
    gaps: Vec<f64>,
    /// Tokens generated (the usage chunk, else the text chunks).
    tokens: usize,
    error: Option<String>,
}

/// Reads an HTTP/1.1 chunked body's next chunk (`None` at the end).
fn read_chunk(r: &mut impl BufRead) -> std::io::Result<Option<Vec<u8>>> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Ok(None);
    }
    let n = usize::from_str_radix(line.trim().split(';').next().unwrap_or("0"), 16).unwrap_or(0);
    if n == 0 {
        return Ok(None);
    }
    let mut buf = vec![0u8; n + 2];
    r.read_exact(&mut buf)?;
    buf.truncate(n);
    Ok(Some(buf))
}

/// One streamed completion; leaves after `leave_after` texts when given.
fn stream(addr: SocketAddr, body: &Value, leave_after: Option<usize>) -> Trace {
    let mut t = Trace::default();
    let run = |t: &mut Trace| -> Result<()> {
        let mut s = TcpStream::connect(addr)?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(Duration::from_secs(1800)))?;
        let body = body.to_string();
        let sent = Instant::now();
        write!(
            s,
            "POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )?;
        let mut r = BufReader::new(s);
        let mut head = String::new();
        let mut chunked = false;
        loop {
            let mut line = String::new();
            r.read_line(&mut line)?;
            if line.to_ascii_lowercase().contains("transfer-encoding: chunked") {
                chunked = true;
            }
            if line == "\r\n" || line.is_empty() {
                break;
            }
            head.push_str(&line);
        }
        if !head.starts_with("HTTP/1.1 200") {
            let mut rest = String::new();
            let _ = r.read_to_string(&mut rest);
            bail!("{} {rest}", head.lines().next().unwrap_or(""));
        }
        let (mut pending, mut texts, mut last) = (String::new(), 0usize, sent);
        loop {
            let data = if chunked {
                match read_chunk(&mut r)? {
                    Some(d) => d,
                    None => break,
                }
            } else {
                let mut buf = vec![0u8; 4096];
                match r.read(&mut buf)? {
                    0 => break,
                    n => buf[..n].to_vec(),
                }
            };
            pending.push_str(&String::from_utf8_lossy(&data));
            while let Some(end) = pending.find("\n\n") {
                let event: String = pending.drain(..end + 2).collect();
                let Some(payload) = event.lines().find_map(|l| l.strip_prefix("data: ")) else { continue };
                if payload == "[DONE]" {
                    return Ok(());
                }
                let v: Value = serde_json::from_str(payload).unwrap_or(Value::Null);
                if let Some(e) = v.get("error") {
                    bail!("server error: {e}");
                }
                if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                    t.tokens = n as usize;
                }
                let text = v["choices"][0]["text"].as_str().unwrap_or("");
                if !text.is_empty() {
                    let now = Instant::now();
                    match t.ttft {
                        None => t.ttft = Some((now - sent).as_secs_f64()),
                        Some(_) => t.gaps.push((now - last).as_secs_f64()),
                    }
                    last = now;
                    texts += 1;
                    if t.tokens < texts {
                        t.tokens = texts;
                    }
                    if leave_after.is_some_and(|k| texts >= k) {
                        return Ok(());
                    }
                }
            }
        }
        Ok(())
    };
    if let Err(e) = run(&mut t) {
        t.error = Some(e.to_string());
    }
    t
}

/// Polls the server's metrics while a load runs: peak concurrent sequences and KV in use.
struct Poller {
    stop: Arc<AtomicBool>,
    handle: std::thread::JoinHandle<(f64, f64)>,
}

impl Poller {
    fn start(addr: SocketAddr, llama: bool) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = std::thread::spawn(move || {
            let (mut running, mut kv) = (0.0f64, 0.0f64);
            while !flag.load(Ordering::Relaxed) {
                if let Ok((200, text)) = get(addr, "/metrics") {
                    let value = |name: &str| {
                        text.lines()
                            .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse::<f64>().ok()))
                            .unwrap_or(0.0)
                    };
                    if llama {
                        running = running.max(value("llamacpp:requests_processing"));
                    } else {
                        running = running.max(value("veloq_requests_running"));
                        kv = kv.max(value("veloq_kv_in_use_bytes"));
                    }
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            (running, kv)
        });
        Self { stop, handle }
    }

    fn finish(self) -> (f64, f64) {
        self.stop.store(true, Ordering::Relaxed);
        self.handle.join().unwrap_or((0.0, 0.0))
    }
}

fn percentile(v: &mut [f64], p: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[((v.len() - 1) as f64 * p).round() as usize])
}

/// Runs `bodies` from `clients` threads at once (each takes the next body until none are left).
fn load(addr: SocketAddr, bodies: Vec<Value>, clients: usize, leave_after: Option<usize>) -> (Vec<Trace>, f64) {
    let queue = Arc::new(Mutex::new(bodies.into_iter().collect::<std::collections::VecDeque<_>>()));
    let t0 = Instant::now();
    let threads: Vec<_> = (0..clients.max(1))
        .map(|_| {
            let q = queue.clone();
            std::thread::spawn(move || {
                let mut out = Vec::new();
                loop {
                    // The lock is released before the request runs.
                    let Some(b) = q.lock().expect("queue").pop_front() else { break };
                    out.push(stream(addr, &b, leave_after));
                }
                out
            })
        })
        .collect();
    let traces: Vec<Trace> = threads.into_iter().flat_map(|t| t.join().unwrap_or_default()).collect();
    (traces, t0.elapsed().as_secs_f64())
}

fn body(server: &Server, prompt: &[u32], max_tokens: usize) -> Value {
    let mut b = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": true,
                       "ignore_eos": true, "stream_options": {"include_usage": true}});
    if let Server::Llama { cache_prompt, .. } = server {
        b["cache_prompt"] = json!(cache_prompt);
    }
    b
}

/// What a server's metrics say it fed: veloq's prompt tokens, llama-server's prompt tokens
/// processed (both count only what ran through the model).
fn prompt_tokens_fed(addr: SocketAddr, llama: bool) -> Option<f64> {
    let (_, text) = get(addr, "/metrics").ok()?;
    let name = if llama { "llamacpp:prompt_tokens_total" } else { "veloq_prompt_tokens_total" };
    text.lines().find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse::<f64>().ok()))
}

/// The conversation load: `a.conversations` clients, each running `a.turns` turns in order, every
/// turn's prompt the previous one plus `a.turn_tokens` new tokens (the history resent). Returns
/// the row it printed.
fn conversations(a: &Args, s: &Server, r: &Running, take: &mut dyn FnMut(usize) -> Vec<u32>) -> Value {
    let firsts: Vec<Vec<u32>> = (0..a.conversations).map(|_| take(a.first_prompt)).collect();
    let turns: Vec<Vec<Vec<u32>>> = firsts
        .into_iter()
        .map(|first| {
            let mut history = first;
            let mut out = vec![history.clone()];
            for _ in 1..a.turns {
                history.extend(take(a.turn_tokens));
                out.push(history.clone());
            }
            out
        })
        .collect();
    let sent: usize = turns.iter().flatten().map(Vec::len).sum();
    let fed_before = prompt_tokens_fed(r.addr, r.llama);
    let t0 = Instant::now();
    let threads: Vec<_> = turns
        .into_iter()
        .map(|conv| {
            let bodies: Vec<Value> = conv.iter().map(|p| body(s, p, a.max_tokens)).collect();
            let addr = r.addr;
            std::thread::spawn(move || bodies.iter().map(|b| stream(addr, b, None)).collect::<Vec<Trace>>())
        })
        .collect();
    let traces: Vec<Vec<Trace>> = threads.into_iter().map(|t| t.join().unwrap_or_default()).collect();
    let secs = t0.elapsed().as_secs_f64();
    let fed = prompt_tokens_fed(r.addr, r.llama).zip(fed_before).map(|(after, before)| after - before);
    let errors = traces.iter().flatten().filter(|t| t.error.is_some()).count();
    let tokens: usize = traces.iter().flatten().map(|t| t.tokens).sum();
    let mut first: Vec<f64> = traces.iter().filter_map(|c| c.first()?.ttft).collect();
    let mut later: Vec<f64> = traces.iter().flat_map(|c| c.iter().skip(1).filter_map(|t| t.ttft)).collect();
    let (f50, l50, l99) = (percentile(&mut first, 0.5), percentile(&mut later, 0.5), percentile(&mut later, 0.99));
    let ms = |v: Option<f64>| v.map_or("—".to_string(), |s| format!("{:.0}", s * 1e3));
    println!(
        "{:<34} conversations {}×{} turns: {secs:>6.1} s, {sent} prompt tok sent, {} fed | TTFT turn 1 p50 {:>6} ms, later turns p50 {:>6} p99 {:>6} ms | {:.1} gen tok/s | {errors} errors",
        s.label(),
        a.conversations,
        a.turns,
        fed.map_or("—".to_string(), |f| format!("{f:.0}")),
        ms(f50),
        ms(l50),
        ms(l99),
        tokens as f64 / secs,
    );
    if let Some(e) = traces.iter().flatten().find_map(|t| t.error.clone()) {
        println!("    first error: {e}");
    }
    json!({"server": s.label(), "load": "conversations", "conversations": a.conversations, "turns": a.turns,
           "first_prompt": a.first_prompt, "turn_tokens": a.turn_tokens, "seconds": secs,
           "prompt_tokens_sent": sent, "prompt_tokens_fed": fed, "ttft_first_p50_s": f50,
           "ttft_later_p50_s": l50, "ttft_later_p99_s": l99, "generated_tokens": tokens, "errors": errors})
}

pub fn run(a: Args) -> Result<()> {
    if let Some(src) = &a.replot {
        let run: Value =
            serde_json::from_str(&std::fs::read_to_string(src).with_context(|| src.display().to_string())?)?;
        return plot(a.plot.as_deref().context("--replot needs --plot")?, &run);
    }
    // Prompts as token ids, each request from its own place in Emma (a synthetic model: random
    // ids), so every server sees the same tokens.
    let model_path = a.files.model();
    let (elements_per_position, head_dim, cost, product, ids) = match model_path
        .to_str()
        .and_then(|p| p.strip_prefix("synthetic:"))
    {
        Some(name) => {
            if a.llama_server.is_some() {
                bail!("llama-server needs a GGUF file, not synthetic:{name}");
            }
            let (g, _) = veloq_lab::synthetic::geometry(name)?;
            let mut rng = veloq_lab::synthetic::Rng(0x2545_F491_4F6C_DD1D);
            let ids: Vec<u32> =
                (0..400_000).map(|_| (rng.uniform() * g.vocab as f64) as u32 % g.vocab as u32).collect();
            (2 * g.layers * g.kv_heads * g.head_dim, g.head_dim, Cost::of_geometry(&g), (g.hidden, g.ffn), ids)
        }
        None => {
            let mut reader = std::io::BufReader::new(std::fs::File::open(&model_path)?);
            let content = candle_core::quantized::gguf_file::Content::read(&mut reader)
                .with_context(|| format!("reading {}", model_path.display()))?;
            let tok = load_tokenizer(&content)?;
            let arch = content
                .metadata
                .get("general.architecture")
                .and_then(|v| v.to_string().ok())
                .cloned()
                .unwrap_or_default();
            let md = |k: &str| {
                content.metadata.get(&format!("{arch}.{k}")).and_then(|v| v.to_u32().ok()).unwrap_or(0) as usize
            };
            let (layers, heads, kv_heads) =
                (md("block_count"), md("attention.head_count"), md("attention.head_count_kv"));
            let head_dim = match md("attention.key_length") {
                0 => md("embedding_length") / heads.max(1),
                d => d,
            };
            let cost = Cost::of_gguf(&content, layers, heads, head_dim);
            let text = a.files.text("emma");
            let ids = encode(&tok, &std::fs::read_to_string(&text).with_context(|| text.display().to_string())?)?;
            (2 * layers * kv_heads * head_dim, head_dim, cost, (md("embedding_length"), md("feed_forward_length")), ids)
        }
    };
    let mut offset = 0usize;
    let mut take = |n: usize| -> Vec<u32> {
        if offset + n > ids.len() {
            offset = 0;
        }
        let p = ids[offset..offset + n].to_vec();
        offset += n + 97;
        p
    };

    if a.step_tokens.contains(&0) {
        bail!("--step-tokens: a forward pass takes at least one token");
    }
    let synthetic = model_path.to_str().is_some_and(|p| p.starts_with("synthetic:"));
    let mut servers = Vec::new();
    for &method in &a.methods {
        let calibration = (method.needs_calibration() && !synthetic).then(|| a.files.calibration(&method));
        let label = if synthetic && method.needs_calibration() {
            format!("{method} (random codebooks)")
        } else {
            method.to_string()
        };
        for &weights in &a.weights {
            for &reserve in &a.reserve {
                for &step_tokens in &a.step_tokens {
                    let (label, calibration) = (label.clone(), calibration.clone());
                    servers.push(Server::Veloq {
                        label,
                        method,
                        calibration,
                        prefix_cache: true,
                        reserve,
                        weights,
                        step_tokens,
                    });
                }
            }
        }
    }
    if a.llama_server.is_some() {
        servers.extend(a.llama_kv.iter().map(|kv| Server::Llama { kv: kv.clone(), cache_prompt: false }));
    }
    let conversation_context = a.first_prompt + a.turns.saturating_sub(1) * a.turn_tokens + a.max_tokens;
    if a.turns > 0 && conversation_context > a.max_context.unwrap_or(a.capacity_context) {
        bail!(
            "a conversation reaches {conversation_context} positions, over the servers' context: raise --max-context or shorten it"
        );
    }

    println!(
        "KV budget {} for every server; {} threads; prompts {:?} cycled, {} tokens each (ignore_eos)",
        human(a.kv_budget),
        a.threads,
        a.prompts,
        a.max_tokens
    );
    // The device's rates for the physical estimate, measured before any server holds it. GPU runs
    // only: on the CPU the quantized products (integer dot products) outrun any f32 matmul rate,
    // so an estimate from one would not bound them.
    let shape = (4096, product.0.max(1), product.1.max(1));
    let rates = match a.device {
        Device::Cpu => None,
        d => {
            let r = Rates::measure(&d.open(&CudaOptions::default())?, shape, 1 << 30)
                .context("measuring the device's matmul and copy rates")?;
            println!(
                "{d}: {:.0} TFLOP/s f16 matmul ([{}×{}]·[{}×{}]ᵀ), {:.0} GB/s memory (a GEMV's reads, a copy's reads + writes); a decode step reads weights of {}",
                r.matmul_flops / 1e12,
                shape.0,
                shape.1,
                shape.2,
                shape.1,
                r.memory_bytes / 1e9,
                a.weights.iter().map(|&w| format!("{} ({w})", human(cost.weight_bytes(w) as usize))).collect::<Vec<_>>().join(", ")
            );
            Some(r)
        }
    };
    let mut rows = Vec::new();
    for s in &servers {
        if a.turns > 0 {
            // Conversations: prefix reuse off, then on, each on a fresh process.
            for on in [false, true] {
                let s = s.with_prefix_reuse(on);
                let r = start(&a, &s, elements_per_position, a.conversations)?;
                rows.push(conversations(&a, &s, &r, &mut take));
            }
        }
        if a.conversations_only {
            continue;
        }
        // Capacity: 4k-context requests, as many at once as the budget admits.
        let cap_prompt = 64usize;
        let parallel = a.capacity_requests;
        let r = start(&a, s, elements_per_position, parallel)?;
        let bodies: Vec<Value> =
            (0..a.capacity_requests).map(|_| body(s, &take(cap_prompt), a.capacity_context - cap_prompt)).collect();
        let poll = Poller::start(r.addr, r.llama);
        let (traces, secs) = load(r.addr, bodies, a.capacity_requests, Some(4));
        let (peak, _) = poll.finish();
        let errors = traces.iter().filter(|t| t.error.is_some()).count();
        let kv_bytes = r.llama_kv_bytes;
        println!(
            "{:<34} capacity: {:.0} concurrent {}-context sequences (of {} sent at once; {errors} errors; {secs:.1} s){}",
            s.label(),
            peak,
            a.capacity_context,
            a.capacity_requests,
            kv_bytes.map_or(String::new(), |b| format!("; llama KV {}", human(b as usize)))
        );
        if let Some(e) = traces.iter().find_map(|t| t.error.clone()) {
            println!("    first error: {e}");
        }
        rows.push(json!({"server": s.label(), "load": "capacity", "context": a.capacity_context,
                         "requests": a.capacity_requests, "peak_concurrent": peak, "errors": errors,
                         "seconds": secs, "llama_kv_bytes": kv_bytes}));
        drop(r);
        if a.capacity_only {
            continue;
        }

        // Throughput at each concurrency, one fresh process for all levels.
        let top = a.concurrency.iter().copied().max().unwrap_or(1);
        let r = start(&a, s, elements_per_position, top)?;
        let context = a.max_context.unwrap_or(a.capacity_context);
        let lengths = |n: usize| (0..n).map(|i| a.prompts[i % a.prompts.len()]).collect::<Vec<_>>();
        if let Some(&first) = a.concurrency.first().filter(|_| !a.no_warmup) {
            let n = first.max(a.min_requests);
            let bodies = lengths(n).into_iter().map(|len| body(s, &take(len), 4)).collect();
            let (traces, secs) = load(r.addr, bodies, first, None);
            let errors = traces.iter().filter(|t| t.error.is_some()).count();
            println!(
                "{:<34} warm-up: {n} requests of 4 tokens in {secs:.1} s, not counted ({errors} errors)",
                s.label()
            );
        }
        for &c in &a.concurrency {
            let n = c.max(a.min_requests);
            let prompts = lengths(n);
            let bodies: Vec<Value> = prompts
                .iter()
                .map(|&len| {
                    let max_tokens = if a.open_ended { context.saturating_sub(len).max(1) } else { a.max_tokens };
                    body(s, &take(len), max_tokens)
                })
                .collect();
            let prompt_tokens: usize = prompts.iter().sum();
            let poll = Poller::start(r.addr, r.llama);
            let (traces, secs) = load(r.addr, bodies, c, a.open_ended.then_some(a.max_tokens));
            let (peak, kv_peak) = poll.finish();
            let tokens: usize = traces.iter().map(|t| t.tokens).sum();
            let errors = traces.iter().filter(|t| t.error.is_some()).count();
            let mut ttft: Vec<f64> = traces.iter().filter_map(|t| t.ttft).collect();
            let mut itl: Vec<f64> = traces.iter().flat_map(|t| t.gaps.iter().copied()).collect();
            let ms = |v: Option<f64>| v.map_or("—".to_string(), |s| format!("{:.0}", s * 1e3));
            let (t50, t99, i50, i99) = (
                percentile(&mut ttft, 0.5),
                percentile(&mut ttft, 0.99),
                percentile(&mut itl, 0.5),
                percentile(&mut itl, 0.99),
            );
            let rss = r.peak_rss();
            println!(
                "{:<34} N={c:<3} {n:>3} requests {prompt_tokens:>6} prompt tok: {:>7.1} gen tok/s | TTFT p50 {:>6} p99 {:>6} ms | ITL p50 {:>5} p99 {:>5} ms | peak {:>3.0} seqs{} | RSS {} | {errors} errors",
                s.label(),
                tokens as f64 / secs,
                ms(t50),
                ms(t99),
                ms(i50),
                ms(i99),
                peak,
                if r.llama { String::new() } else { format!(", KV in use {}", human(kv_peak as usize)) },
                rss.map_or("—".into(), |b| human(b as usize)),
            );
            if let Some(e) = traces.iter().find_map(|t| t.error.clone()) {
                println!("    first error: {e}");
            }
            let estimate = match &rates {
                Some(rates) => {
                    let kv_bytes_per_position = s.cache_bytes_per_element(head_dim)? * elements_per_position as f64;
                    let level = Level { prompts: &prompts, clients: c, kv_bytes_per_position };
                    let (est, line) = estimate(&a, s, rates, &cost, &level, tokens as f64 / secs);
                    println!("{:<34}        {line}", "");
                    est
                }
                None => Value::Null,
            };
            rows.push(json!({"server": s.label(), "load": "throughput", "concurrency": c, "requests": n, "open_ended": a.open_ended,
                             "prompt_tokens": prompt_tokens, "generated_tokens": tokens, "seconds": secs,
                             "gen_tok_s": tokens as f64 / secs, "ttft_p50_s": t50, "ttft_p99_s": t99,
                             "itl_p50_s": i50, "itl_p99_s": i99, "peak_concurrent": peak,
                             "kv_in_use_peak_bytes": if r.llama { Value::Null } else { json!(kv_peak) },
                             "peak_rss_bytes": rss, "errors": errors, "estimate": estimate}));
        }
    }
    let capacity = |label: &str| {
        rows.iter()
            .find(|r| r["load"] == "capacity" && r["server"] == label)
            .and_then(|r| r["peak_concurrent"].as_f64())
    };
    if let Some(base) = capacity("veloq fp16").filter(|&b| b > 0.0) {
        for s in &servers {
            if let Some(c) = capacity(&s.label()) {
                println!(
                    "{:<34} serves {:.2}× the concurrent {}-context sequences of veloq fp16",
                    s.label(),
                    c / base,
                    a.capacity_context
                );
            }
        }
    }
    let out = json!({"bench": "serve", "model": model_path, "device": a.device.to_string(), "kv_budget_bytes": a.kv_budget,
                     "rates": rates.map(|r| json!({"matmul_flops": r.matmul_flops, "memory_bytes": r.memory_bytes,
                                                   "matmul_shape": [shape.0, shape.1, shape.2]})),
                     "threads": a.threads, "prompts": a.prompts, "max_tokens": a.max_tokens, "rows": rows});
    if let Some(path) = &a.plot {
        plot(path, &out)?;
    }
    write_json(&a.json, &out)?;
    match failures(&out["rows"]) {
        Some(which) => bail!("requests failed ({which}): the figures above count only the requests that finished"),
        None => Ok(()),
    }
}

/// A throughput level as the estimate needs it.
struct Level<'a> {
    prompts: &'a [usize],
    clients: usize,
    kv_bytes_per_position: f64,
}

/// A throughput level's physical estimate for server `s` (JSON, and the line that says it and how
/// much of it `measured` gen tok/s is): as many sequences a step as the budget holds at the load's
/// mean context (`roofline::Load::slots`).
fn estimate(a: &Args, s: &Server, rates: &Rates, cost: &Cost, l: &Level, measured: f64) -> (Value, String) {
    let (prompts, kv_bytes_per_position) = (l.prompts, l.kv_bytes_per_position);
    let level = roofline::Load {
        prompts,
        max_tokens: a.max_tokens,
        slots: roofline::Load::slots(a.kv_budget, kv_bytes_per_position, prompts, a.max_tokens, l.clients),
        kv_bytes_per_position,
        weight_bytes: s.weight_bytes(cost),
    };
    let e = roofline::estimate(cost, rates, &level);
    let tok_s = (prompts.len() * a.max_tokens) as f64 / e.seconds();
    let line = format!(
        "physical estimate {:.2} s (prompts {:.2} s + decode {:.2} s at {} sequences a step): {:.0} gen tok/s; measured {:.0}% of it",
        e.seconds(),
        e.prefill_s,
        e.decode_s,
        level.slots,
        tok_s,
        100.0 * measured / tok_s
    );
    let json = json!({"seconds": e.seconds(), "prefill_s": e.prefill_s, "decode_s": e.decode_s,
                      "slots": level.slots, "gen_tok_s": tok_s});
    (json, line)
}

/// The loads in which requests failed (`server load: n`), if any: a failed request is a hole in
/// the figures, so the run reports it and exits non-zero after writing them.
fn failures(rows: &Value) -> Option<String> {
    let failed: Vec<String> = rows
        .as_array()?
        .iter()
        .filter_map(|r| {
            let n = r["errors"].as_u64().filter(|&n| n > 0)?;
            let level = r["concurrency"].as_u64().map_or(String::new(), |c| format!(" N={c}"));
            Some(format!("{} {}{level}: {n}", r["server"].as_str().unwrap_or("?"), r["load"].as_str().unwrap_or("?")))
        })
        .collect();
    (!failed.is_empty()).then(|| failed.join(", "))
}

/// Aggregate tok/s and TTFT p50 against concurrency, a line per server, from a run's JSON.
fn plot(path: &std::path::Path, run: &Value) -> Result<()> {
    let rows = run["rows"].as_array().context("a bench serve JSON has rows")?;
    let mut labels: Vec<&str> = Vec::new();
    for r in rows.iter().filter(|r| r["load"] == "throughput") {
        let l = r["server"].as_str().unwrap_or("");
        if !labels.contains(&l) {
            labels.push(l);
        }
    }
    let series = |k: &str| -> Vec<(String, Vec<(f64, f64)>)> {
        labels
            .iter()
            .map(|&l| {
                let pts = rows
                    .iter()
                    .filter(|r| r["load"] == "throughput" && r["server"] == l)
                    .filter_map(|r| Some((r["concurrency"].as_f64()?, r[k].as_f64()?)))
                    .collect();
                (l.to_string(), pts)
            })
            .collect()
    };
    let panels = vec![
        ("aggregate generated tok/s".to_string(), series("gen_tok_s")),
        ("time to first token p50 (s)".to_string(), series("ttft_p50_s")),
    ];
    let device = match run["device"].as_str().unwrap_or("cpu") {
        "cpu" => "CPU".to_string(),
        d => d.to_uppercase(),
    };
    let budget = human(run["kv_budget_bytes"].as_u64().unwrap_or(0) as usize);
    veloq_lab::plot::speed(path, &format!("{device}, KV budget {budget}"), "concurrent clients", "", &panels)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_requests_are_named_and_clean_runs_pass() {
        let clean = json!([{"server": "veloq fp16", "load": "capacity", "errors": 0},
                           {"server": "veloq vq-4", "load": "throughput", "concurrency": 32, "errors": 0}]);
        assert_eq!(failures(&clean), None);
        let failed = json!([{"server": "veloq fp16", "load": "throughput", "concurrency": 128, "errors": 3},
                            {"server": "veloq vq-4", "load": "throughput", "concurrency": 128, "errors": 0},
                            {"server": "veloq vq-2", "load": "capacity", "errors": 1}]);
        assert_eq!(failures(&failed).as_deref(), Some("veloq fp16 throughput N=128: 3, veloq vq-2 capacity: 1"));
    }
}
