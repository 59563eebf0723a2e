//! Long prompts on the CPU, side by side in one run: veloq's chunked prefill (fp16 and VecInfer
//! caches) and llama.cpp's `llama-bench` (f16 and q4_0 KV, flash attention), each at every thread
//! count asked for; prefill tok/s, decode tok/s after the prompt, and the memory the prefill adds.
//!
//! Each veloq measurement runs in a child process (this binary, `--one`), because the thread
//! pools are fixed per process and the peak RSS must be the prefill's own: the child resets the
//! kernel's high-water mark after loading the model, prefills, decodes, and reports the growth.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args as ClapArgs;
use serde_json::{json, Value};

use veloq_candle::model::{encode, Logits, Model};
use veloq_candle::prefill::{prefill, DEFAULT_CHUNK};
use veloq_candle::Method;

use super::{cache_for, write_json};
use veloq_cli::args::Files as ModelFiles;

#[derive(ClapArgs)]
pub struct Args {
    #[command(flatten)]
    pub(crate) files: ModelFiles,
    /// Prompt lengths (tokens of Emma, from its start).
    #[arg(long, value_delimiter = ',', default_value = "1024,4096,8192")]
    lengths: Vec<usize>,
    /// Thread counts (veloq: rayon's pool, candle's own ops on 1; llama.cpp: -t).
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    threads: Vec<usize>,
    /// veloq's methods, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "fp16,vq-4")]
    methods: Vec<Method>,
    /// Decode steps timed after each prompt (0: none).
    #[arg(long, default_value_t = 16)]
    decode_steps: usize,
    #[arg(long, default_value_t = DEFAULT_CHUNK)]
    chunk: usize,
    /// llama.cpp's llama-bench binary (scripts/llama-cpp builds it); without it veloq runs alone.
    #[arg(long)]
    llama_bench: Option<PathBuf>,
    #[arg(long)]
    json: Option<PathBuf>,
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Internal: one measurement (method,length) in this process, printed as JSON.
    #[arg(long, hide = true)]
    one: Option<String>,
}

fn status_kib(key: &str) -> Option<usize> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines().find(|l| l.starts_with(key))?.split_whitespace().nth(1)?.parse().ok()
}

/// The child: load, reset the RSS high-water mark, prefill, decode; one JSON line on stdout.
fn one(a: &Args, spec: &str) -> Result<()> {
    let (method, len) = spec.split_once(',').context("--one method,length")?;
    let len: usize = len.parse()?;
    let model_path = a.files.model();
    let (model, tok) = Model::open(&model_path, len + a.decode_steps + 1)?;
    let config = cache_for(&a.files, &method.parse()?, &model)?;
    let text = a.files.text("emma");
    let ids = encode(&tok, &std::fs::read_to_string(&text).with_context(|| text.display().to_string())?)?;
    if ids.len() < len + a.decode_steps {
        bail!("{} has {} tokens, fewer than {len}", text.display(), ids.len());
    }
    let mut caches = config.build(&model)?;
    // Linux: writing 5 resets VmHWM to the current RSS.
    let reset = std::fs::write("/proc/self/clear_refs", "5").is_ok();
    let before = status_kib("VmRSS:").unwrap_or(0);
    let start = Instant::now();
    let logits = prefill(&model, &mut caches, 0, &ids[..len], a.chunk, &mut |_, _| {})?;
    let prefill_s = start.elapsed().as_secs_f64();
    let peak = status_kib("VmHWM:").unwrap_or(0);
    let mut next = logits.argmax(0)?.to_scalar::<u32>()?;
    let start = Instant::now();
    for _ in 0..a.decode_steps {
        next = model.forward(&[next], &mut caches, Logits::Last)?.squeeze(0)?.argmax(0)?.to_scalar::<u32>()?;
    }
    let decode_s = start.elapsed().as_secs_f64();
    println!(
        "{}",
        json!({"engine": "veloq", "method": config.name(), "length": len, "threads": rayon::current_num_threads(),
               "prefill_tok_s": len as f64 / prefill_s, "decode_tok_s": a.decode_steps as f64 / decode_s.max(1e-9),
               "rss_before_prefill_bytes": before * 1024, "rss_peak_prefill_bytes": peak * 1024,
               "rss_growth_bytes": peak.saturating_sub(before) * 1024, "hwm_reset": reset,
               "kv_resident_bytes": caches.resident_bytes()})
    );
    Ok(())
}

fn child(a: &Args, method: &str, len: usize, threads: usize) -> Result<Value> {
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(exe);
    cmd.args(["bench", "prefill", "--one", &format!("{method},{len}")])
        .args(["--decode-steps", &a.decode_steps.to_string(), "--chunk", &a.chunk.to_string()])
        .env("RAYON_NUM_THREADS", threads.to_string())
        .env("CANDLE_NUM_THREADS", "1");
    if let Some(m) = &a.files.model {
        cmd.arg("--model").arg(m);
    }
    if let Some(c) = &a.files.calibration {
        cmd.arg("--calibration").arg(c);
    }
    cmd.arg("--cache-dir").arg(&a.files.cache_dir);
    let out = cmd.output()?;
    if !out.status.success() {
        bail!("veloq {method} at {len}: {}", String::from_utf8_lossy(&out.stderr));
    }
    let line = String::from_utf8_lossy(&out.stdout);
    Ok(serde_json::from_str(line.lines().last().unwrap_or(""))?)
}

/// llama-bench, one configuration: prefill of `len` (pp) and, when asked, decode at depth `len`.
fn llama(a: &Args, bin: &PathBuf, cache: &str, len: usize, threads: usize) -> Result<Value> {
    let run = |extra: &[String]| -> Result<f64> {
        let out = Command::new(bin)
            .arg("-m")
            .arg(a.files.model())
            .args(["-fa", "1", "-r", "1", "-o", "json", "-ctk", cache, "-ctv", cache, "-t", &threads.to_string()])
            .args(extra)
            .output()
            .with_context(|| format!("running {}", bin.display()))?;
        if !out.status.success() {
            bail!("llama-bench: {}", String::from_utf8_lossy(&out.stderr));
        }
        let v: Value = serde_json::from_slice(&out.stdout)?;
        v[0]["avg_ts"].as_f64().context("llama-bench JSON without avg_ts")
    };
    let pp = run(&["-p".into(), len.to_string(), "-n".into(), "0".into()])?;
    let tg = if a.decode_steps > 0 {
        Some(run(&["-p".into(), "0".into(), "-n".into(), a.decode_steps.to_string(), "-d".into(), len.to_string()])?)
    } else {
        None
    };
    Ok(json!({"engine": "llama.cpp", "method": format!("{cache} KV"), "length": len, "threads": threads,
              "prefill_tok_s": pp, "decode_tok_s": tg}))
}

pub fn run(a: Args) -> Result<()> {
    if let Some(spec) = &a.one {
        return one(&a, spec);
    }
    let mut rows: Vec<Value> = Vec::new();
    println!("prefill in chunks of {}, then {} decode steps; veloq's candle ops on 1 thread", a.chunk, a.decode_steps);
    println!(
        "{:>9} {:>7} {:>18} {:>6} | {:>11} {:>10} | {:>12} {:>9}",
        "engine", "threads", "method", "length", "prefill t/s", "decode t/s", "prefill +RSS", "KV"
    );
    for &len in &a.lengths {
        for &t in &a.threads {
            let mut here = Vec::new();
            for m in &a.methods {
                here.push(child(&a, &m.to_string(), len, t)?);
            }
            if let Some(bin) = &a.llama_bench {
                for cache in ["f16", "q4_0"] {
                    here.push(llama(&a, bin, cache, len, t)?);
                }
            }
            for r in here {
                let mib = |k: &str| r[k].as_f64().map_or("—".to_string(), |b| format!("{:.1} MiB", b / 1048576.0));
                println!(
                    "{:>9} {:>7} {:>18} {:>6} | {:>11.1} {:>10} | {:>12} {:>9}",
                    r["engine"].as_str().unwrap_or(""),
                    t,
                    r["method"].as_str().unwrap_or(""),
                    len,
                    r["prefill_tok_s"].as_f64().unwrap_or(f64::NAN),
                    r["decode_tok_s"].as_f64().map_or("—".into(), |v| format!("{v:.1}")),
                    mib("rss_growth_bytes"),
                    mib("kv_resident_bytes"),
                );
                rows.push(r);
            }
        }
    }
    if let Some(path) = &a.plot {
        let mut panels: veloq_lab::plot::Panels = Vec::new();
        for &t in &a.threads {
            let mut lines: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
            for r in rows.iter().filter(|r| r["threads"].as_u64() == Some(t as u64)) {
                let label = format!("{} {}", r["engine"].as_str().unwrap_or(""), r["method"].as_str().unwrap_or(""));
                let p = (r["length"].as_f64().unwrap_or(0.0), r["prefill_tok_s"].as_f64().unwrap_or(0.0));
                match lines.iter_mut().find(|l| l.0 == label) {
                    Some(l) => l.1.push(p),
                    None => lines.push((label, vec![p])),
                }
            }
            panels.push((format!("prefill, {t} thread{}", if t == 1 { "" } else { "s" }), lines));
        }
        veloq_lab::plot::speed(path, "CPU", "context (tokens)", "prefill tokens/s", &panels)?;
    }
    write_json(&a.json, &json!({"bench": "prefill", "chunk": a.chunk, "decode_steps": a.decode_steps, "rows": rows}))
}
