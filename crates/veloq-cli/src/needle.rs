//! `veloq eval needle`: passkey retrieval over a grid of context lengths × needle depths, several
//! keys per cell, in prose and filler haystacks, for each cache method; a table with 95% Wilson
//! intervals, JSON of every answer, and a heatmap per (method, haystack). The prompts of a cell are
//! the same for every method.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args as ClapArgs;
use serde_json::json;

use veloq::kernels::select::KernelChoice;
use veloq_candle::config::CacheConfig;
use veloq_candle::model::{encode, Model};
use veloq_candle::needle::{self, answer, correct, keys, wilson};

use crate::calibrate::{bar, default_text};
use crate::eval::{calibration_tokens, calibrations, chosen_methods, config, read_tokens};
use crate::generate::default_model;
use crate::plot::{self, Heat};

#[derive(ClapArgs)]
pub struct Args {
    #[arg(long)]
    model: Option<PathBuf>,
    /// Context lengths (tokens, the whole prompt), comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1024,2048,4096,8192")]
    lengths: Vec<usize>,
    /// Needle depths in percent of the haystack (0 = its start), comma separated.
    #[arg(long, value_delimiter = ',', default_value = "0,10,20,30,40,50,60,70,80,90,100")]
    depths: Vec<f64>,
    /// Keys per (length, depth, haystack) cell.
    #[arg(long, default_value_t = 3)]
    keys: usize,
    /// Haystacks: prose (the novel, from a different place per key) and/or filler.
    #[arg(long, value_delimiter = ',', default_value = "prose,filler")]
    haystacks: Vec<String>,
    /// The prose haystack (default: Emma).
    #[arg(long)]
    text: Option<PathBuf>,
    /// Methods (`veloq eval --list`), comma separated; fp16 always runs.
    #[arg(long, value_delimiter = ',', default_value = "vq-2")]
    methods: Vec<String>,
    /// Calibration text for the VecInfer methods (default: Persuasion), and its tokens.
    #[arg(long)]
    calib_text: Option<PathBuf>,
    #[arg(long, default_value_t = 8192)]
    calib_tokens: usize,
    /// Ask as a plain completion ("… The pass key is") even when the model has a chat template
    /// (by default the question is a user turn and the answer the assistant's reply).
    #[arg(long)]
    raw: bool,
    /// Tokens generated for the answer (an instruct model may restate the question first).
    #[arg(long, default_value_t = 16)]
    answer_tokens: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Fused kernels: auto, require or forbid.
    #[arg(long, default_value = "auto")]
    kernels: String,
    #[arg(long)]
    json: Option<PathBuf>,
    /// Heatmap PNG (one panel per method and haystack).
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Redraw the heatmap (--plot) from an earlier run's JSON; runs nothing.
    #[arg(long)]
    replot: Option<PathBuf>,
}

/// Per (depth row, length column): correct answers, questions asked.
type Grid = Vec<Vec<(usize, usize)>>;

/// The heatmap of an earlier run's JSON (its grid and answers).
fn replot(json: &std::path::Path, out: &std::path::Path) -> Result<()> {
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(json)?)?;
    let nums = |k: &str| -> Vec<f64> { v[k].as_array().into_iter().flatten().filter_map(|x| x.as_f64()).collect() };
    let (lengths, depths) = (nums("lengths").iter().map(|&l| l as usize).collect::<Vec<_>>(), nums("depths_percent"));
    let mut heats: Vec<(String, String, Grid)> = Vec::new();
    for a in v["answers"].as_array().context("no answers in the JSON")? {
        let (m, h) = (a["method"].as_str().unwrap_or("?"), a["haystack"].as_str().unwrap_or("?"));
        let li = lengths.iter().position(|&l| Some(l as u64) == a["length"].as_u64()).context("length")?;
        let di = depths.iter().position(|&d| Some(d) == a["depth_percent"].as_f64()).context("depth")?;
        let i = match heats.iter().position(|x| x.0 == m && x.1 == h) {
            Some(i) => i,
            None => {
                heats.push((m.into(), h.into(), vec![vec![(0, 0); lengths.len()]; depths.len()]));
                heats.len() - 1
            }
        };
        let cell = &mut heats[i].2[di][li];
        cell.0 += (a["correct"].as_bool() == Some(true)) as usize;
        cell.1 += 1;
    }
    let panels: Vec<Heat> = heats
        .into_iter()
        .map(|(m, h, cells)| {
            let (k, n) = cells.iter().flatten().fold((0, 0), |s, c| (s.0 + c.0, s.1 + c.1));
            Heat { title: format!("{m}, {h}: {k}/{n}"), cells }
        })
        .collect();
    plot::heatmap(out, &lengths, &depths.iter().map(|d| d / 100.0).collect::<Vec<_>>(), &panels)?;
    eprintln!("wrote {}", out.display());
    Ok(())
}

pub fn run(a: Args) -> Result<()> {
    if let Some(json) = &a.replot {
        return replot(json, a.plot.as_deref().context("--replot needs --plot")?);
    }
    if a.lengths.is_empty() || a.depths.is_empty() || a.keys == 0 {
        bail!("needs at least one length, one depth and one key");
    }
    if let Some(d) = a.depths.iter().find(|d| !(0.0..=100.0).contains(*d)) {
        bail!("depth {d}% is outside 0..=100");
    }
    let chosen = chosen_methods(&a.methods)?;
    let model_path = a.model.clone().unwrap_or_else(default_model);
    let max_len = *a.lengths.iter().max().expect("checked");
    let device = crate::device::parse(&a.device)?;
    let kernels = KernelChoice::parse(&a.kernels)?;
    let capacity = max_len + a.answer_tokens;
    let (model, tok) =
        Model::open_on(&model_path, capacity, &device).with_context(|| format!("loading {}", model_path.display()))?;
    let calib_path = a.calib_text.clone().unwrap_or_else(default_text);
    let calib = calibration_tokens(&tok, &calib_path, a.calib_tokens)?;
    // Calibrations come from the CPU model over windows as long as the longest prompt.
    let cals = if device.is_cpu() {
        calibrations(&model, &model_path, &calib, &chosen, a.seed, max_len)?
    } else {
        let (cpu, _) = Model::open(&model_path, capacity)?;
        calibrations(&cpu, &model_path, &calib, &chosen, a.seed, max_len)?
    };
    let methods: Vec<(String, CacheConfig)> =
        chosen.iter().zip(cals).map(|((l, k), c)| (l.to_string(), CacheConfig { kernels, ..config(*k, c) })).collect();

    let text_path = a.text.clone().unwrap_or_else(|| default_text().with_file_name("emma.txt"));
    let (prefix, question) = needle::frame(&model, &tok, !a.raw)?;
    let keys = keys(a.seed, a.keys * a.lengths.len() * a.depths.len() * a.haystacks.len());
    let mut hays: Vec<(String, Vec<u32>)> = Vec::new();
    for h in &a.haystacks {
        match h.as_str() {
            "prose" => hays.push((h.clone(), read_tokens(&tok, &text_path)?)),
            "filler" => hays.push((h.clone(), needle::filler(&tok, max_len + 64 * a.keys)?)),
            other => bail!("unknown haystack {other:?} (prose, filler)"),
        }
    }
    // Every case once, in a fixed order; answers per method.
    struct Case {
        hay: usize,
        length: usize,
        depth: usize,
        key: u32,
        ids: Vec<u32>,
    }
    let mut cases = Vec::new();
    let mut next_key = keys.iter();
    for (hi, (name, hay)) in hays.iter().enumerate() {
        for &length in &a.lengths {
            for (di, &depth) in a.depths.iter().enumerate() {
                for i in 0..a.keys {
                    let key = *next_key.next().expect("enough keys");
                    let needle_ids = encode(&tok, &needle::needle(key))?;
                    // Each key reads the haystack from its own offset (prose) or phase (filler).
                    let offset = if name == "prose" {
                        (i * 7919 + di * 104_729) % hay.len().saturating_sub(length).max(1)
                    } else {
                        i * 7
                    };
                    let ids = needle::prompt(&prefix, &hay[offset..], &needle_ids, &question, length, depth / 100.0)
                        .with_context(|| format!("{name} haystack, length {length}"))?;
                    cases.push(Case { hay: hi, length, depth: di, key, ids });
                }
            }
        }
    }
    let total: usize = cases.iter().map(|c| c.ids.len()).sum::<usize>() * methods.len();
    println!(
        "{}: {} cases × {} methods, {} prompt tokens in all; greedy {} tokens, the first number must equal the key",
        model.info.identity.name,
        cases.len(),
        methods.len(),
        total,
        a.answer_tokens
    );
    let b = bar(total as u64, "needles");
    let mut done = 0u64;
    let mut rows = Vec::new();
    // results[method][hay][depth][length] = (correct, asked)
    let mut results =
        vec![vec![vec![vec![(0usize, 0usize); a.lengths.len()]; a.depths.len()]; hays.len()]; methods.len()];
    for (mi, (label, cfg)) in methods.iter().enumerate() {
        for c in &cases {
            let text = answer(&model, &tok, cfg, &c.ids, a.answer_tokens)
                .with_context(|| format!("{label}, length {}", c.length))?;
            let ok = correct(&text, c.key);
            let li = a.lengths.iter().position(|&l| l == c.length).expect("a grid length");
            let cell = &mut results[mi][c.hay][c.depth][li];
            cell.0 += ok as usize;
            cell.1 += 1;
            rows.push(json!({"method": label, "haystack": hays[c.hay].0, "length": c.length,
                "depth_percent": a.depths[c.depth], "key": c.key, "answer": text, "correct": ok}));
            done += c.ids.len() as u64;
            b.set_position(done);
        }
    }
    b.finish();

    let mut heats = Vec::new();
    let mut summary = Vec::new();
    for (mi, (label, _)) in methods.iter().enumerate() {
        for (hi, (hay, _)) in hays.iter().enumerate() {
            let cells = &results[mi][hi];
            let (k, n) = cells.iter().flatten().fold((0, 0), |s, c| (s.0 + c.0, s.1 + c.1));
            let (lo, hi_ci) = wilson(k, n);
            println!(
                "\n{label}, {hay} haystack: {k}/{n} = {:.0}% (95% CI {:.0}–{:.0}%)",
                100.0 * k as f64 / n as f64,
                100.0 * lo,
                100.0 * hi_ci
            );
            print!("| depth \\ tokens |");
            a.lengths.iter().for_each(|l| print!(" {l} |"));
            println!();
            println!("|---|{}", "---|".repeat(a.lengths.len()));
            for (di, row) in cells.iter().enumerate() {
                print!("| {:.0}% |", a.depths[di]);
                row.iter().for_each(|(k, n)| print!(" {k}/{n} |"));
                println!();
            }
            summary.push(json!({"method": label, "haystack": hay, "correct": k, "asked": n, "wilson95": [lo, hi_ci]}));
            heats.push(Heat { title: format!("{label}, {hay}: {k}/{n}"), cells: cells.clone() });
        }
    }
    if let Some(p) = &a.plot {
        plot::heatmap(p, &a.lengths, &a.depths.iter().map(|d| d / 100.0).collect::<Vec<_>>(), &heats)?;
        eprintln!("wrote {}", p.display());
    }
    crate::bench::write_json(
        &a.json,
        &json!({"model": model.info.identity.name, "device": format!("{device:?}"), "lengths": a.lengths,
                "depths_percent": a.depths, "keys_per_cell": a.keys, "chat": !a.raw, "text": text_path.file_name().map(|s| s.to_string_lossy().into_owned()),
                "summary": summary, "answers": rows}),
    )
}
