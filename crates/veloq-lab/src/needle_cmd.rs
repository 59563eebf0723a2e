//! `veloq eval needle`: passkey retrieval over a grid of context lengths × needle depths, several
//! keys per cell, in prose and filler haystacks, for each cache method; a table with 95% Wilson
//! intervals, JSON of every answer, and a heatmap per (method, haystack). The prompts of a cell are
//! the same for every method.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args as ClapArgs;
use serde_json::json;
use veloq::calibrate::ValueWeights;

use veloq::kernels::KernelChoice;
use veloq_candle::config::{CacheConfig, WindowConfig};
use veloq_candle::model::{encode, LoadOptions, Model, Tokenizer};
use veloq_candle::runtime::Device;
use veloq_candle::Method;
use veloq_cli::args::{CudaFlags, Files};
use veloq_cli::progress::bar;
use veloq_lab::needle::{self, answers, correct, keys, wilson};
use veloq_lab::plot::{self, Heat};
use veloq_lab::probe::{needle_attention, HeadMass, KeyCoder};

use veloq_lab::book_cache::BookCache;
use veloq_lab::calibrations::{
    calibration_tokens, calibrations, chosen_methods, config, read_tokens, set_f16_rows, Candidate,
};
use veloq_lab::source::{sources, CacheSource};

use crate::candidate_args::CandidateArgs;

#[derive(ClapArgs)]
pub struct Args {
    #[command(flatten)]
    pub(crate) files: Files,
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
    methods: Vec<Method>,
    /// Calibration text for the VecInfer methods (default: Persuasion), and its tokens.
    #[arg(long)]
    calib_text: Option<PathBuf>,
    #[arg(long, default_value_t = 8192)]
    calib_tokens: usize,
    /// Positions per calibration window (default: the longest length), so that a smaller grid
    /// can reuse the calibrations of a larger one.
    #[arg(long)]
    calib_window: Option<usize>,
    /// Ask as a plain completion ("… The pass key is") even when the model has a chat template
    /// (by default the question is a user turn and the answer the assistant's reply).
    #[arg(long)]
    raw: bool,
    /// Tokens generated for the answer (an instruct model may restate the question first).
    #[arg(long, default_value_t = 16)]
    answer_tokens: usize,
    /// Prompts answered together (one cache slot each, prefilled and decoded as one batch);
    /// default 1 on the CPU (already busy with one), 16 on a GPU.
    #[arg(long)]
    batch: Option<usize>,
    /// Prefill chunk per prompt (tokens per forward pass).
    #[arg(long, default_value_t = veloq_candle::prefill::DEFAULT_CHUNK)]
    chunk: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// What the VecInfer methods' value codebooks weigh rows by (`veloq calibrate
    /// --value-weights`): uniform or attention.
    #[arg(long, default_value = "uniform")]
    value_weights: ValueWeights,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: Device,
    /// Fused kernels: auto, require or forbid.
    #[arg(long, value_enum, default_value_t = KernelChoice::Auto)]
    kernels: KernelChoice,
    #[command(flatten)]
    cuda: CudaFlags,
    #[arg(long)]
    json: Option<PathBuf>,
    /// Heatmap PNG (one panel per method and haystack).
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Instead of answering: teacher-force each cell's first prompt with its key as the answer and
    /// report, per (layer, head), the attention mass on the needle with exact and with each
    /// method's coded keys, and the score error there and elsewhere (VecInfer methods).
    #[arg(long)]
    probe: bool,
    /// Positions every coded method (and candidate) keeps in f16 beside its codes, `SINK/RECENT`
    /// (first positions for good / recent ones after a flush; default 4/16, 0/16 for `/no-sink`).
    #[arg(long)]
    f16_rows: Option<WindowConfig>,
    #[command(flatten)]
    candidates: CandidateArgs,
    /// Answer with the candidates only (`--second-stage`, `--apart`, `--outlier-rows`, `--per-head`, `--rescore`, `--rescore-keys`), not fp16
    /// and the methods themselves: the prompts are those of an earlier run with the same
    /// lengths, depths, keys, haystacks and seed, whose answers they pair with.
    #[arg(long)]
    candidates_only: bool,
    /// Answer with only these runs, by label (a method such as `fp16`, or a candidate's
    /// `sim:…` label as the table prints it), comma separated: a grid on a borrowed GPU pays for
    /// the one candidate it is about and its fp16 pairs, not for every candidate built beside it.
    #[arg(long, value_delimiter = ',')]
    runs: Vec<String>,
    /// Train (or find in the cache) the methods' calibrations, and the books of the candidates
    /// asked for that train any (`--value-mass`, `--turning-keys`), and stop: prepares a run on
    /// another machine (copy ~/.cache/veloq/eval there).
    #[arg(long)]
    calibrate_only: bool,
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

/// The runs named in `names` (`--runs`), in the grid's order; a name that is not a run is an error
/// that lists the runs there are.
fn only<T>(runs: Vec<(String, T)>, names: &[String]) -> Result<Vec<(String, T)>> {
    if let Some(n) = names.iter().find(|n| !runs.iter().any(|r| &r.0 == *n)) {
        let there: Vec<&str> = runs.iter().map(|r| r.0.as_str()).collect();
        bail!("--runs {n}: no such run; this grid has {}", there.join(", "));
    }
    Ok(runs.into_iter().filter(|r| names.contains(&r.0)).collect())
}

/// Runs the grid (or the probe).
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
    let chosen = chosen_methods(&a.methods);
    let model_path = a.files.model();
    let max_len = *a.lengths.iter().max().expect("checked");
    let device = a.device.open(&a.cuda.options(&a.files.cache_dir))?;
    let kernels = a.kernels;
    let capacity = max_len + a.answer_tokens;
    let calib_window = a.calib_window.unwrap_or(max_len);
    let (model, tok) = Model::open_with(&model_path, &LoadOptions::new(capacity), &device)
        .with_context(|| format!("loading {}", model_path.display()))?;
    a.candidates.check_on(model.device(), a.seed)?;
    let calib_path = a.calib_text.clone().unwrap_or_else(|| a.files.text("persuasion"));
    let calib = calibration_tokens(&tok, &calib_path, a.calib_tokens)?;
    // Calibrations come from the CPU model over windows as long as the longest prompt (or
    // --calib-window).
    let on_cpu = device.is_cpu() && calib_window <= capacity;
    let cpu = if on_cpu { None } else { Some(Model::open(&model_path, capacity.max(calib_window))?.0) };
    let calib_model = cpu.as_ref().unwrap_or(&model);
    let cals = calibrations(
        calib_model,
        &model_path,
        &calib,
        &chosen,
        a.seed,
        calib_window,
        a.value_weights,
        &a.files.cache_dir,
    )?;
    let mut candidates = a.candidates.build(
        calib_model,
        &calib,
        calib_window,
        &chosen,
        &cals,
        a.seed,
        Some(BookCache::new(&a.files.cache_dir, &model_path)?),
    )?;
    // The candidates' trained books are in the cache now too.
    if a.calibrate_only {
        eprintln!("calibrations ready in {}", a.files.cache_dir.join("eval").display());
        return Ok(());
    }
    let mut methods: Vec<(String, CacheConfig)> = chosen
        .iter()
        .zip(cals)
        .map(|(m, c)| Ok((m.to_string(), CacheConfig { kernels, ..config(*m, c)? })))
        .collect::<Result<_>>()?;
    set_f16_rows(a.f16_rows, &mut methods, &mut candidates);
    let mut runs = if a.candidates_only { Vec::new() } else { sources(&methods) };
    runs.extend(candidates.iter().map(|c| (c.label.clone(), &c.simulation as &dyn CacheSource)));
    if !a.runs.is_empty() {
        runs = only(runs, &a.runs)?;
    }
    if runs.is_empty() {
        bail!("--candidates-only, and no candidate asked for (--second-stage, --apart, --outlier-rows, --per-head, --residual, --value-mass, --turning-keys, --rescore, --rescore-keys, --key-heads)");
    }

    let text_path = a.text.clone().unwrap_or_else(|| a.files.text("emma"));
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
        /// The cell's first key (the one `--probe` uses).
        first: bool,
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
                    cases.push(Case { hay: hi, length, depth: di, key, ids, first: i == 0 });
                }
            }
        }
    }
    if a.probe {
        let first: Vec<&Case> = cases.iter().filter(|c| c.first).collect();
        return probe(
            &model,
            &tok,
            &methods,
            &candidates,
            &first.iter().map(|c| (c.ids.as_slice(), c.key)).collect::<Vec<_>>(),
            &a.json,
        );
    }
    let total: usize = cases.iter().map(|c| c.ids.len()).sum::<usize>() * runs.len();
    println!(
        "{}: {} cases × {} methods, {} prompt tokens in all; greedy {} tokens, the first number must equal the key",
        model.info.identity.name,
        cases.len(),
        runs.len(),
        total,
        a.answer_tokens
    );
    let batch_size = a.batch.unwrap_or(if device.is_cpu() { 1 } else { 16 }).max(1);
    let b = bar(total as u64, "needles");
    let mut done = 0u64;
    let mut rows: Vec<serde_json::Value> = Vec::new();
    // results[method][hay][depth][length] = (correct, asked)
    let mut results = vec![vec![vec![vec![(0usize, 0usize); a.lengths.len()]; a.depths.len()]; hays.len()]; runs.len()];
    let header = json!({"model": model.info.identity.name, "device": format!("{device:?}"), "lengths": a.lengths,
        "depths_percent": a.depths, "keys_per_cell": a.keys, "chat": !a.raw, "batch": batch_size,
        "f16_rows": a.f16_rows.map(|w| w.to_string()), "value_weights": a.value_weights.name(),
        "outlier_rows": a.candidates.outlier_rows,
        "per_head": a.candidates.per_head,
        "rescore": a.candidates.rescore,
        "rescore_keys": a.candidates.rescore_keys,
        "turning_keys": a.candidates.turning_keys,
        "value_mass": a.candidates.value_mass,
        "text": text_path.file_name().map(|s| s.to_string_lossy().into_owned())});
    let write = |extra: serde_json::Value| -> Result<()> {
        let mut v = header.clone();
        v.as_object_mut().expect("an object").extend(extra.as_object().cloned().unwrap_or_default());
        crate::bench::write_json(&a.json, &v)
    };
    let mut timing = Vec::new();
    // A method that fails (say, out of device memory) is reported and left out; the others run.
    let mut failed: Vec<(usize, String)> = Vec::new();
    'methods: for (mi, (label, cfg)) in runs.iter().enumerate() {
        let start = std::time::Instant::now();
        let before = done;
        // Cases of one length together: a batch's prompts end within a chunk of each other.
        for (li, &length) in a.lengths.iter().enumerate() {
            let group: Vec<&Case> = cases.iter().filter(|c| c.length == length).collect();
            for batch in group.chunks(batch_size) {
                let prompts: Vec<Vec<u32>> = batch.iter().map(|c| c.ids.clone()).collect();
                let texts = match answers(&model, &tok, *cfg, &prompts, a.answer_tokens, a.chunk) {
                    Ok(t) => t,
                    Err(e) => {
                        let why = format!("{label}, length {length}: {e:#}");
                        b.suspend(|| eprintln!("failed, left out: {why}"));
                        rows.retain(|r| r["method"].as_str() != Some(label.as_str()));
                        failed.push((mi, why));
                        continue 'methods;
                    }
                };
                for (c, text) in batch.iter().zip(texts) {
                    let ok = correct(&text, c.key);
                    let cell = &mut results[mi][c.hay][c.depth][li];
                    cell.0 += ok as usize;
                    cell.1 += 1;
                    rows.push(json!({"method": label, "haystack": hays[c.hay].0, "length": c.length,
                        "depth_percent": a.depths[c.depth], "key": c.key, "answer": text, "correct": ok}));
                    done += c.ids.len() as u64;
                }
                b.set_position(done);
            }
        }
        let secs = start.elapsed().as_secs_f64();
        let right: usize = results[mi].iter().flatten().flatten().map(|c| c.0).sum();
        b.suspend(|| {
            eprintln!(
                "{label}: {right}/{} right, {} prompt tokens in {secs:.1} s ({:.0} tok/s)",
                cases.len(),
                done - before,
                (done - before) as f64 / secs
            )
        });
        // Rescoring candidates: what their decode steps read again, per (step, layer, kv head).
        let reread = candidates.iter().find(|c| &c.label == label).and_then(|c| c.simulation.reread_counts());
        if let Some(r) = &reread {
            b.suspend(|| {
                eprintln!(
                    "{label}: a decode step reads {:.1} distinct positions per layer and kv head again; {:.1} of them \
                     the step before did not, {:.1} were not among the {} read last, {:.1} no earlier step read \
                     ({} followed steps × layers × kv heads)",
                    r.rows_per_head(),
                    r.new_per_head(),
                    r.not_recent_per_head(),
                    veloq_lab::reread_log::RECENT,
                    r.unseen_per_head(),
                    r.followed
                )
            });
        }
        timing.push(json!({"method": label, "seconds": secs, "prompt_tokens": done - before, "reread": reread}));
        // Every method's answers on disk as soon as they exist (--replot draws a partial run).
        write(json!({"timing": timing, "answers": rows}))?;
    }
    b.finish();
    let failures: Vec<&str> = failed.iter().map(|f| f.1.as_str()).collect();

    let mut heats = Vec::new();
    let mut summary = Vec::new();
    for (mi, (label, _)) in runs.iter().enumerate() {
        if failed.iter().any(|f| f.0 == mi) {
            continue;
        }
        for (hi, (hay, _)) in hays.iter().enumerate() {
            let cells = &results[mi][hi];
            let (k, n) = cells.iter().flatten().fold((0, 0), |s, c| (s.0 + c.0, s.1 + c.1));
            let (lo, hi_ci) = wilson(k, n);
            // Outlier candidates: the fraction of coded rows they kept in f16 on these prompts.
            let kept = candidates.iter().find(|c| &c.label == label).and_then(|c| c.simulation.outliers());
            let kept = kept.map(|o| o.kept_fraction());
            println!(
                "\n{label}, {hay} haystack: {k}/{n} = {:.0}% (95% CI {:.0}–{:.0}%){}",
                100.0 * k as f64 / n as f64,
                100.0 * lo,
                100.0 * hi_ci,
                kept.map(|f| format!("; {:.2}% of coded rows kept in f16", 100.0 * f)).unwrap_or_default()
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
            summary.push(json!({"method": label, "haystack": hay, "correct": k, "asked": n, "wilson95": [lo, hi_ci],
                "outlier_rows_kept": kept}));
            heats.push(Heat { title: format!("{label}, {hay}: {k}/{n}"), cells: cells.clone() });
        }
    }
    // The JSON first: a figure that cannot be drawn (no font on a server) loses no answers.
    write(json!({"timing": timing, "summary": summary, "failed": failures, "answers": rows}))?;
    if let Some(p) = &a.plot {
        plot::heatmap(p, &a.lengths, &a.depths.iter().map(|d| d / 100.0).collect::<Vec<_>>(), &heats)?;
        eprintln!("wrote {}", p.display());
    }
    if !failures.is_empty() {
        bail!("{} of {} methods failed: {}", failures.len(), runs.len(), failures.join("; "));
    }
    Ok(())
}

/// `--probe`: the attention mass on the needle per (layer, head) while the key is read back,
/// exact keys against each VecInfer method's, averaged over `cases` (prompt, key).
fn probe(
    model: &Model,
    tok: &Tokenizer,
    methods: &[(String, CacheConfig)],
    candidates: &[Candidate],
    cases: &[(&[u32], u32)],
    json_path: &Option<PathBuf>,
) -> Result<()> {
    let mut coded: Vec<(&str, &dyn KeyCoder, &WindowConfig)> = methods
        .iter()
        .filter_map(|(l, c)| c.calibration.as_ref().map(|cal| (l.as_str(), cal.as_ref() as &dyn KeyCoder, &c.window)))
        .collect();
    let Some(window) = coded.first().map(|c| c.2) else { bail!("--probe needs at least one VecInfer method") };
    // Candidates keep the cache's sink and window here: the probe compares keys, not caches.
    coded.extend(candidates.iter().map(|c| (c.label.as_str(), &c.simulation as &dyn KeyCoder, window)));
    let cals: Vec<&dyn KeyCoder> = coded.iter().map(|c| c.1).collect();
    let b = bar(cases.len() as u64, "probing");
    let mut sum: Vec<HeadMass> = Vec::new();
    for (n, &(ids, key)) in cases.iter().enumerate() {
        let needle_ids = encode(tok, &needle::needle(key))?;
        let at = ids
            .windows(needle_ids.len())
            .position(|w| w == needle_ids.as_slice())
            .context("needle not in its prompt")?;
        let answer = encode(tok, &key.to_string())?;
        let full: Vec<u32> = ids.iter().chain(&answer).copied().collect();
        let heads = needle_attention(model, &full, at..at + needle_ids.len(), ids.len(), &cals, window)?;
        if sum.is_empty() {
            sum = heads;
        } else {
            for (s, h) in sum.iter_mut().zip(heads) {
                s.exact += h.exact;
                let add = |a: &mut Vec<f32>, b: Vec<f32>| a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
                add(&mut s.coded, h.coded);
                add(&mut s.err_needle, h.err_needle);
                add(&mut s.err_rest, h.err_rest);
            }
        }
        b.set_position(n as u64 + 1);
    }
    b.finish();
    let k = cases.len() as f32;
    for s in &mut sum {
        s.exact /= k;
        for v in [&mut s.coded, &mut s.err_needle, &mut s.err_rest] {
            v.iter_mut().for_each(|x| *x /= k);
        }
    }
    println!(
        "Attention on the needle while the key is read back: {} prompts teacher-forced with the key as the answer; \
         mass = share of a head's softmax on the needle's tokens, mean over the answer's positions; \
         score error = RMS of (coded − exact) scaled q·k on the needle's positions / elsewhere",
        cases.len()
    );
    let mut order: Vec<&HeadMass> = sum.iter().collect();
    order.sort_by(|a, b| b.exact.total_cmp(&a.exact));
    print!("| layer.head | fp16 mass |");
    coded.iter().for_each(|c| print!(" {} mass | {} score error needle / rest |", c.0, c.0));
    println!("\n|---|---|{}", "---|---|".repeat(coded.len()));
    for h in order.iter().take(12) {
        print!("| {}.{} | {:.3} |", h.layer, h.head, h.exact);
        for i in 0..coded.len() {
            print!(" {:.3} | {:.2} / {:.2} |", h.coded[i], h.err_needle[i], h.err_rest[i]);
        }
        println!();
    }
    // Retrieval heads: those that put at least a tenth of their attention on the needle.
    let retrieval: Vec<&HeadMass> = sum.iter().filter(|h| h.exact >= 0.1).collect();
    let exact: f32 = retrieval.iter().map(|h| h.exact).sum();
    let mut summary = Vec::new();
    for (i, c) in coded.iter().enumerate() {
        let kept: f32 = retrieval.iter().map(|h| h.coded[i]).sum();
        let mean =
            |f: &dyn Fn(&HeadMass) -> f32| retrieval.iter().map(|h| f(h)).sum::<f32>() / retrieval.len().max(1) as f32;
        let (en, er) = (mean(&|h| h.err_needle[i]), mean(&|h| h.err_rest[i]));
        println!(
            "{}: the {} heads with ≥ 0.1 of their attention on the needle keep {:.0}% of it (mass {:.2} of {:.2}); \
             score error on the needle {en:.2}, elsewhere {er:.2}",
            c.0,
            retrieval.len(),
            100.0 * kept / exact.max(f32::MIN_POSITIVE),
            kept,
            exact
        );
        summary
            .push(json!({"method": c.0, "retrieval_heads": retrieval.len(), "mass_exact": exact, "mass_coded": kept,
            "score_rms_needle": en, "score_rms_rest": er}));
    }
    let heads: Vec<_> = sum
        .iter()
        .map(|h| {
            json!({"layer": h.layer, "head": h.head, "exact": h.exact, "coded": h.coded,
            "score_rms_needle": h.err_needle, "score_rms_rest": h.err_rest})
        })
        .collect();
    crate::bench::write_json(
        json_path,
        &json!({"model": model.info.identity.name, "prompts": cases.len(),
            "methods": coded.iter().map(|c| c.0).collect::<Vec<_>>(), "summary": summary, "heads": heads}),
    )
}

#[cfg(test)]
mod tests {
    use super::only;

    fn runs() -> Vec<(String, usize)> {
        ["fp16", "sim:vq-2/turning-keys", "sim:vq-2/value-mass100%"]
            .iter()
            .enumerate()
            .map(|(i, l)| (l.to_string(), i))
            .collect()
    }

    #[test]
    fn runs_keep_the_named_ones_in_grid_order() {
        let kept = only(runs(), &["sim:vq-2/value-mass100%".into(), "fp16".into()]).unwrap();
        assert_eq!(kept, vec![("fp16".to_string(), 0), ("sim:vq-2/value-mass100%".to_string(), 2)]);
    }

    #[test]
    fn an_unknown_run_names_the_ones_there_are() {
        let e = only(runs(), &["fp16".into(), "sim:vq-2/turning".into()]).unwrap_err().to_string();
        assert!(e.contains("sim:vq-2/turning:") && e.contains("sim:vq-2/turning-keys"), "{e}");
    }
}
