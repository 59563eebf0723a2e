//! Which key smoothing rule quantizes real keys better: none, s = max|k|, or s = √max|k|.
//! Calibrates on one novel, then measures on another (teacher-forced decode over codes) the KL of
//! the next-token distribution from fp16's, the top-1 agreement, and the key-score error.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args as ClapArgs;
use serde_json::json;

use veloq::codec::codebook::PqShape;
use veloq::codec::smooth::SmoothRule;
use veloq::codec::vecinfer::CodecSpec;
use veloq_candle::collect::{calibrate, collect_activations};
use veloq_candle::config::CacheConfig;
use veloq_candle::model::{encode, Model};

use super::write_json;
use crate::calibrate::default_text;
use crate::generate::default_model;

#[derive(ClapArgs)]
pub struct Args {
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long, default_value_t = 4096)]
    calib_tokens: usize,
    /// Prefill before the measured steps.
    #[arg(long, default_value_t = 512)]
    prefill: usize,
    #[arg(long, default_value_t = 64)]
    steps: usize,
    #[arg(long, default_value_t = 4)]
    sub_dim: usize,
    #[arg(long, default_value_t = 8)]
    bits: u32,
    #[arg(long)]
    json: Option<PathBuf>,
}

fn log_softmax(l: &[f32]) -> Vec<f64> {
    let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let s: f64 = l.iter().map(|&x| (x as f64 - m).exp()).sum();
    l.iter().map(|&x| x as f64 - m - s.ln()).collect()
}

pub fn run(a: Args) -> Result<()> {
    let model_path = a.model.clone().unwrap_or_else(default_model);
    let (model, tok) = Model::open(&model_path, (a.prefill + a.steps + 1).max(512))?;
    let calib = encode(&tok, &std::fs::read_to_string(default_text())?)?;
    let eval = encode(&tok, &std::fs::read_to_string(default_text().with_file_name("emma.txt"))?)?;
    let acts = collect_activations(&model, &calib[..a.calib_tokens], 512, &mut |_| {})?;
    let shape = PqShape::new(a.sub_dim, a.bits)?;
    let span = &eval[10_000..10_000 + a.prefill + a.steps + 1];
    // fp16 reference distributions for each teacher-forced step.
    let reference = {
        let mut c = CacheConfig::fp16().build(&model)?;
        model.forward(&span[..a.prefill], &mut c, false)?;
        (0..a.steps)
            .map(|i| {
                Ok(model
                    .forward(&span[a.prefill + i..a.prefill + i + 1], &mut c, false)?
                    .flatten_all()?
                    .to_vec1::<f32>()?)
            })
            .collect::<Result<Vec<_>>>()?
    };
    println!(
        "key smoothing on {} calibration tokens (Persuasion), {} decode steps after {} tokens of Emma, {}-bit/{} codes",
        a.calib_tokens, a.steps, a.prefill, a.bits, a.sub_dim
    );
    println!("{:>14} | {:>9} {:>8}", "rule", "KL", "top-1");
    let mut rows = Vec::new();
    for rule in [None, Some(SmoothRule::MaxAbs), Some(SmoothRule::SqrtMaxAbs)] {
        let keys = CodecSpec { smooth: rule, ..CodecSpec::keys(shape) };
        let cal = calibrate(&model, &acts, keys, CodecSpec::values(shape), 0, &mut |_| {})?;
        let mut c = CacheConfig::vecinfer(cal).build(&model)?;
        model.forward(&span[..a.prefill], &mut c, false)?;
        let (mut kl, mut agree) = (0.0, 0);
        for (i, r) in reference.iter().enumerate() {
            let l = model
                .forward(&span[a.prefill + i..a.prefill + i + 1], &mut c, false)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let (p, q) = (log_softmax(r), log_softmax(&l));
            kl += p.iter().zip(&q).map(|(a, b)| a.exp() * (a - b)).sum::<f64>();
            let am = |x: &[f64]| x.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0;
            agree += (am(&p) == am(&q)) as usize;
        }
        let name = rule.map_or("none", |r| r.name());
        let kl = kl / a.steps as f64;
        let top1 = agree as f64 / a.steps as f64;
        println!("{name:>14} | {kl:>9.4} {top1:>8.3}");
        rows.push(json!({"rule": name, "kl": kl, "top1": top1}));
    }
    write_json(
        &a.json,
        &json!({"bench": "smooth", "calib_tokens": a.calib_tokens, "prefill": a.prefill, "steps": a.steps, "sub_dim": a.sub_dim, "bits": a.bits, "rows": rows}),
    )
}
