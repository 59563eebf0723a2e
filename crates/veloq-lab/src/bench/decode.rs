//! Decode speed of the fp16 and VecInfer caches at several context lengths, same run, same
//! model: prefill real text (in chunks), then time single-token decode steps.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args as ClapArgs;
use serde_json::json;

use veloq_candle::config::{fp16_bytes, CacheConfig};
use veloq_candle::model::{encode, Logits, Model};
use veloq_candle::Method;

use super::{cache_for, write_json};
use veloq_cli::args::Files as ModelFiles;

#[derive(ClapArgs)]
pub struct Args {
    #[command(flatten)]
    pub(crate) files: ModelFiles,
    /// Context lengths to measure at.
    #[arg(long, value_delimiter = ',', default_value = "256,1024,4096")]
    contexts: Vec<usize>,
    /// Timed decode steps per context.
    #[arg(long, default_value_t = 32)]
    steps: usize,
    /// Text to prefill with (default: Emma).
    #[arg(long)]
    text: Option<PathBuf>,
    /// Methods measured in the same run, comma separated (VecInfer ones read their default
    /// calibration files: `veloq calibrate --method …`).
    #[arg(long, value_delimiter = ',', default_value = "fp16,vq-4")]
    methods: Vec<Method>,
    #[arg(long)]
    json: Option<PathBuf>,
}

pub fn run(a: Args) -> Result<()> {
    let model_path = a.files.model();
    let max_ctx = a.contexts.iter().max().copied().unwrap_or(256) + a.steps + 1;
    let (model, tok) = Model::open(&model_path, max_ctx)?;
    let methods: Vec<CacheConfig> = a.methods.iter().map(|m| cache_for(&a.files, m, &model)).collect::<Result<_>>()?;
    let text_path = a.text.clone().unwrap_or_else(|| a.files.text("emma"));
    let ids = encode(&tok, &std::fs::read_to_string(&text_path).with_context(|| text_path.display().to_string())?)?;
    println!(
        "prefill tok/s (chunks of 512) and decode tok/s ({} steps after it: overall, and of the median step) on real text; threads: candle {}, rayon {}",
        a.steps,
        std::env::var("CANDLE_NUM_THREADS").unwrap_or_else(|_| "default".into()),
        rayon::current_num_threads()
    );
    println!(
        "{:>7} | {:>22} {:>9} {:>9} {:>9} {:>11} | {:>9}",
        "context", "method", "prefill", "tok/s", "median", "KV resident", "vs fp16"
    );
    let mut rows = Vec::new();
    for &ctx in &a.contexts {
        let mut base = None;
        for m in &methods {
            let mut caches = m.build(&model)?;
            let start = Instant::now();
            for chunk in ids[..ctx].chunks(512) {
                model.forward(chunk, &mut caches, Logits::Last)?;
            }
            let prefill = ctx as f64 / start.elapsed().as_secs_f64();
            let start = Instant::now();
            let mut step_s = Vec::with_capacity(a.steps);
            for i in 0..a.steps {
                let t = Instant::now();
                model.forward(&ids[ctx + i..ctx + i + 1], &mut caches, Logits::Last)?;
                step_s.push(t.elapsed().as_secs_f64());
            }
            let tps = a.steps as f64 / start.elapsed().as_secs_f64();
            // The median step: what the machine does when nothing else runs on it (a shared VM's
            // bursts move the mean, not the median).
            step_s.sort_by(f64::total_cmp);
            let median_tps = 1.0 / step_s.get(step_s.len() / 2).copied().unwrap_or(f64::NAN);
            let resident = caches.resident_bytes();
            let ratio = base.map_or(1.0, |b: f64| tps / b);
            base.get_or_insert(tps);
            println!(
                "{ctx:>7} | {:>22} {prefill:>9.1} {tps:>9.2} {median_tps:>9.2} {:>11} | {ratio:>8.2}×",
                m.name(),
                veloq_candle::units::human_bytes(resident)
            );
            rows.push(json!({"context": ctx, "method": m.name(), "prefill_tok_s": prefill, "decode_tok_s": tps, "decode_median_step_tok_s": median_tps, "kv_resident_bytes": resident,
                             "kv_fp16_equivalent_bytes": fp16_bytes(&model, ctx + a.steps), "speed_vs_fp16": ratio}));
        }
    }
    write_json(&a.json, &json!({"bench": "decode", "model": model.info.identity.name, "steps": a.steps, "rows": rows}))
}
