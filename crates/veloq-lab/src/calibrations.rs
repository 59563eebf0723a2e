//! The methods a harness compares and their calibrations: fp16 first, then the named methods,
//! each VecInfer one calibrated once from one activation collection and kept under
//! `<cache dir>/eval` (reused only when made from the same tokens with the same seed and window).

use std::path::Path;

use anyhow::{bail, Context, Result};

use veloq::artifact::Calibration;
use veloq::artifact::ModelIdentity;
use veloq::calibrate::value_weights;
use veloq::calibrate::{train_codec_with_progress, KMeansConfig, TextFingerprint, ValueWeights};
use veloq::codec::codebook::PqShape;
use veloq::codec::vecinfer::{CodecSpec, VecInferCodec};
use veloq_candle::collect::{
    attention_sampling, calibrate_for, calibrate_weighted, coded_mass, record, Activations, LayerActivations, Queries,
};
use veloq_candle::config::{CacheConfig, WindowConfig};
use veloq_candle::method::Vq;
use veloq_candle::model::{encode, Model, Tokenizer};
use veloq_candle::Method;
use veloq_cli::progress::bar;

use veloq_candle::cache::Heads;

use crate::book_cache::{BookCache, Books};
use crate::key_heads;
use crate::rescore::Reread;
use crate::second_stage::{ScoreResidual, StageSide, StageSpec};
use crate::simulate::{outlier_limits, round_trip, Sides, Simulation};
use crate::turning::{self, pre_rope_mean, Rope, TurningKeys};

/// The tokens of the text at `path`.
pub fn read_tokens(tok: &Tokenizer, path: &Path) -> Result<Vec<u32>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading {} (run scripts/fetch-data)", path.display()))?;
    Ok(encode(tok, &text)?)
}

/// The first `n` tokens of the calibration text at `path` (an error naming it when it is shorter).
pub fn calibration_tokens(tok: &Tokenizer, path: &Path, n: usize) -> Result<Vec<u32>> {
    let mut tokens = read_tokens(tok, path)?;
    if tokens.len() < n {
        bail!("{} has {} tokens, fewer than --calib-tokens {n}", path.display(), tokens.len());
    }
    tokens.truncate(n);
    Ok(tokens)
}

/// Calibrations for the VecInfer methods, trained once from one activation collection and cached
/// under ~/.cache/veloq/eval (reused only when made from the same tokens with the same seed and
/// value weights).
#[allow(clippy::too_many_arguments)]
pub fn calibrations(
    model: &Model,
    model_path: &Path,
    calib: &[u32],
    chosen: &[Method],
    seed: u64,
    window: usize,
    value_weights: ValueWeights,
    cache_dir: &Path,
) -> Result<Vec<Option<Calibration>>> {
    let text = TextFingerprint::of_tokens(calib);
    let dir = cache_dir.join("eval");
    std::fs::create_dir_all(&dir)?;
    let stem = model_path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let mut acts: Option<Activations> = None;
    let mut out = Vec::new();
    for method in chosen {
        let Method::VecInfer(Vq { keys, values, .. }) = *method else {
            out.push(None);
            continue;
        };
        let label = method.to_string();
        // Named by what was trained, so methods that differ only in cache settings share a file.
        let weights = match value_weights {
            ValueWeights::Uniform => String::new(),
            w => format!(".{w}"),
        };
        let path = dir.join(format!(
            "{stem}.{:016x}.s{seed}.t{}.w{window}{weights}.safetensors",
            fnv(&format!("{keys:?}{values:?}")),
            calib.len()
        ));
        if let Ok(c) = Calibration::load_for(&path, &model.info.identity) {
            let same = c.keys == keys && c.values == values && c.seed == seed && c.value_weights == value_weights;
            if c.text == text && same {
                out.push(Some(c));
                continue;
            }
        }
        if acts.is_none() {
            let b = bar(calib.len() as u64, "collecting");
            let queries = Queries::for_weights(value_weights, window);
            acts = Some(record(model, calib, window, queries, &mut |n| b.set_position(n as u64))?);
            b.finish();
        }
        let b = bar(model.info.identity.n_layers as u64, &label);
        let by_attention = (value_weights == ValueWeights::Attention).then(|| attention_sampling(window));
        let acts = acts.as_ref().expect("collected");
        let id = &model.info.identity;
        let cal = calibrate_weighted(id, acts, keys, values, seed, by_attention, &mut |n| b.set_position(n as u64))?;
        b.finish();
        cal.save(&path)?;
        out.push(Some(cal));
    }
    Ok(out)
}

pub(crate) fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf29ce484222325, |h, b| (h ^ b as u64).wrapping_mul(0x100000001b3))
}

/// The caches of `method` with its calibration (`None` for the methods that take none).
pub fn config(method: Method, cal: Option<Calibration>) -> Result<CacheConfig> {
    Ok(CacheConfig::new(method, cal)?)
}

/// fp16 first, then the named methods (the whole catalogue when none are named).
pub fn chosen_methods(names: &[Method]) -> Vec<Method> {
    let names = if names.is_empty() { Method::catalogue() } else { names.to_vec() };
    std::iter::once(Method::Fp16).chain(names.into_iter().filter(|m| *m != Method::Fp16)).collect()
}

/// A lab candidate beside the product's methods: its label, what it is, and how to build it.
pub struct Candidate {
    /// `sim:<method>` or `sim:<method>+<stage>`.
    pub label: String,
    /// A line for tables.
    pub description: String,
    /// Its caches.
    pub simulation: Simulation,
}

/// Issue 34's candidates for every calibrated VecInfer method in `chosen`: when `apart`, the
/// method with keys alone and values alone coded (the other side f16); for each of `stages`,
/// the method simulated alone (its codecs in an fp16 cache, [`Simulation`]: what simulating
/// changes against the real cache) and with that key second stage, trained on the calibration
/// text's keys and queries (recorded again, in `window`-position passes). A stage's gain is read
/// against the simulated method.
pub fn simulations(
    model: &Model,
    calib: &[u32],
    window: usize,
    chosen: &[Method],
    cals: &[Option<Calibration>],
    stages: &[StageSpec],
    apart: bool,
) -> Result<Vec<Candidate>> {
    let mut out = Vec::new();
    let hd = model.info.identity.head_dim;
    for (m, cal) in chosen.iter().zip(cals) {
        let Some(cal) = cal else { continue };
        if apart {
            for (sides, label, what) in [(Sides::Keys, "k-only", "values f16"), (Sides::Values, "v-only", "keys f16")] {
                out.push(Candidate {
                    label: format!("sim:{m}/{label}"),
                    description: format!("{}, {what} (simulated)", m.describe(hd)),
                    simulation: Simulation::new(cal, sides, None, None)?,
                });
            }
        }
        if !stages.is_empty() {
            let describe = format!("{} (simulated: f16 cache of its reconstructions)", m.describe(hd));
            out.push(Candidate {
                label: format!("sim:{m}"),
                description: describe,
                simulation: Simulation::new(cal, Sides::Both, None, None)?,
            });
        }
    }
    if stages.is_empty() || cals.iter().all(Option::is_none) {
        return Ok(out);
    }
    let b = bar(calib.len() as u64, "recording queries");
    let acts = record(model, calib, window, Queries::All, &mut |n| b.set_position(n as u64))?;
    b.finish();
    let id = &model.info.identity;
    let heads = Heads { q: model.info.n_heads, kv: id.n_kv_heads, dim: hd };
    // The output projections' rows, as [hidden, heads, head_dim] "queries" of the value stages.
    let projections: Vec<Vec<f32>> = if stages.iter().any(|s| s.side.values()) {
        (0..id.n_layers)
            .map(|l| Ok(model.attention_output(l)?.flatten_all()?.to_vec1::<f32>()?))
            .collect::<Result<_>>()?
    } else {
        Vec::new()
    };
    for (m, cal) in chosen.iter().zip(cals) {
        let Some(cal) = cal else { continue };
        // The first stage's reconstructions, once per method for every stage that needs them.
        let (mut coded_keys, mut coded_values) = (Vec::new(), Vec::new());
        for (a, l) in acts.layers.iter().zip(&cal.layers) {
            if stages.iter().any(|s| s.side.keys()) {
                coded_keys.push(round_trip(&l.keys, &a.keys)?);
            }
            if stages.iter().any(|s| s.side.values()) {
                coded_values.push(round_trip(&l.values, &a.values)?);
            }
        }
        for s in stages {
            let b = bar(id.n_layers as u64, &format!("{m}+{s}"));
            let (mut ks, mut vs) = (Vec::new(), Vec::new());
            for (l, a) in acts.layers.iter().enumerate() {
                let train = |x: &[f32], coded: &[f32], q: &[f32]| {
                    ScoreResidual::train(x, coded, q, heads, s.rank, s.bits).map_err(anyhow::Error::msg)
                };
                if s.side.keys() {
                    ks.push(train(&a.keys, &coded_keys[l], &s.key_queries(&a.queries, heads.q * hd, window))?);
                }
                if s.side.values() {
                    vs.push(train(&a.values, &coded_values[l], &projections[l])?);
                }
                b.inc(1);
            }
            b.finish();
            let extra = s.bits_per_element(hd);
            let what = match s.side {
                StageSide::Keys => "key",
                StageSide::Values => "value",
                StageSide::Both => "key and value",
            };
            out.push(Candidate {
                label: format!("sim:{m}+{s}"),
                description: format!(
                    "{} + {what} second stage: {} coefficients of {} bits per position and kv head (+{extra:.3} bits per element of each){}",
                    m.describe(hd),
                    s.rank,
                    if s.bits == 0 { 32 } else { s.bits },
                    if s.late { ", keys weighed by the last quarter of each calibration window's queries" } else { "" }
                ),
                simulation: Simulation::new(cal, Sides::Both, (!ks.is_empty()).then_some(ks), (!vs.is_empty()).then_some(vs))?,
            });
        }
    }
    Ok(out)
}

/// Issue 34's candidates built from the calibration text's keys and values (recorded again, in
/// `window`-position passes, once for all of them).
#[derive(Clone, Debug, Default)]
pub struct RecordedCandidates {
    /// `--outlier-rows`: fractions of the rows.
    pub outlier_rows: Vec<f64>,
    /// `--per-head`: codebooks per kv head.
    pub per_head: bool,
    /// `--residual`: two residual stages over twice the channels, at the same bits.
    pub residual: bool,
    /// `--value-mass`: fractions of the value books' training rows drawn by attention mass.
    pub value_mass: Vec<f64>,
    /// `--turning-keys`: keys coded around their pre-RoPE mean turned to each position, once per
    /// count of RoPE pairs kept per kv head.
    pub turning_keys: Vec<usize>,
    /// k-means seed (the calibrations').
    pub seed: u64,
    /// Where the value-mass and turning-key books are kept between runs (none: trained every run).
    pub books: Option<BookCache>,
}

/// For every calibrated VecInfer method in `chosen`: with `outlier_rows`, the method simulated with
/// the rows it codes worst kept in f16 ([`Simulation::set_outliers`]), once per fraction (each
/// (layer, kv head)'s limit the `1 − fraction` quantile of the squared coding errors of its rows
/// on the calibration text); with `per_head`, the method with a codebook per kv head
/// ([`Simulation::per_head`]: each head's keys and values trained alone, as `calibrate` trains a
/// layer's); with `residual`, [`residual_candidate`]; with `value_mass`, [`value_mass_books`]
/// once per fraction; with `turning_keys`, [`turning_keys`] once per count of pairs. Value-mass
/// and turning-key books come from `want.books` when an earlier run saved them there (and are
/// saved there when trained); the text is recorded only when something is left to train.
pub fn recorded_candidates(
    model: &Model,
    calib: &[u32],
    window: usize,
    chosen: &[Method],
    cals: &[Option<Calibration>],
    want: &RecordedCandidates,
) -> Result<Vec<Candidate>> {
    if let Some(f) = want.outlier_rows.iter().find(|f| !(0.0..1.0).contains(*f)) {
        bail!("--outlier-rows {f}: a fraction of the rows, at least 0 and below 1");
    }
    if let Some(f) = want.value_mass.iter().find(|f| !(0.0..=1.0).contains(*f)) {
        bail!("--value-mass {f}: a fraction of the training rows, from 0 to 1");
    }
    if want.turning_keys.contains(&0) {
        bail!("--turning-keys 0: at least one RoPE pair a head");
    }
    let none = want.outlier_rows.is_empty()
        && !want.per_head
        && !want.residual
        && want.value_mass.is_empty()
        && want.turning_keys.is_empty();
    if none || cals.iter().all(Option::is_none) {
        return Ok(Vec::new());
    }
    // Books an earlier run trained (and saved) are read, not trained again.
    let load = |cal: &Calibration, what: &str| want.books.as_ref().and_then(|c| c.load(cal, window, want.seed, what));
    let mut saved_mass = Vec::new();
    let mut saved_turning = Vec::new();
    for cal in cals.iter().flatten() {
        saved_mass.push(want.value_mass.iter().map(|&f| load(cal, &mass_name(f))).collect::<Vec<_>>());
        saved_turning.push(want.turning_keys.iter().map(|&p| load(cal, &turning_name(p))).collect::<Vec<_>>());
    }
    let mass_missing = saved_mass.iter().flatten().any(Option::is_none);
    let missing = mass_missing || saved_turning.iter().flatten().any(Option::is_none);
    let acts = if missing || !want.outlier_rows.is_empty() || want.per_head || want.residual {
        let b = bar(calib.len() as u64, "recording keys and values");
        let queries = if mass_missing { Queries::Sampled(attention_sampling(window)) } else { Queries::Skip };
        let acts = record(model, calib, window, queries, &mut |n| b.set_position(n as u64))?;
        b.finish();
        Some(acts)
    } else {
        None
    };
    let masses = match &acts {
        Some(acts) if mass_missing => value_masses(model, acts, window)?,
        _ => Vec::new(),
    };
    let recorded = || acts.as_ref().context("recorded");
    let id = &model.info.identity;
    let (heads, hd) = (id.n_kv_heads, id.head_dim);
    let save = |cal: &Calibration, what: &str, books: &Books| -> Result<()> {
        match &want.books {
            Some(c) => c.save(cal, window, want.seed, what, books),
            None => Ok(()),
        }
    };
    let mut out = Vec::new();
    let mut saved = saved_mass.into_iter().zip(saved_turning);
    for (m, cal) in chosen.iter().zip(cals) {
        let Some(cal) = cal else { continue };
        let (saved_mass, saved_turning) = saved.next().expect("one per calibration");
        if !want.outlier_rows.is_empty() {
            let acts = recorded()?;
            let coded: Vec<(Vec<f32>, Vec<f32>)> = acts
                .layers
                .iter()
                .zip(&cal.layers)
                .map(|(a, l)| Ok((round_trip(&l.keys, &a.keys)?, round_trip(&l.values, &a.values)?)))
                .collect::<Result<_>>()?;
            for &f in &want.outlier_rows {
                let limits = acts
                    .layers
                    .iter()
                    .zip(&coded)
                    .map(|(a, (k, v))| {
                        (outlier_limits(&a.keys, k, heads, hd, f), outlier_limits(&a.values, v, heads, hd, f))
                    })
                    .collect();
                let mut simulation = Simulation::new(cal, Sides::Both, None, None)?;
                simulation.set_outliers(f, limits, hd)?;
                out.push(Candidate {
                    label: format!("sim:{m}+out{}%", f * 100.0),
                    description: format!(
                        "{} + key and value rows coded worst kept in f16 ({}% of the calibration text's rows per layer and head; simulated)",
                        m.describe(hd),
                        f * 100.0
                    ),
                    simulation,
                });
            }
        }
        if want.per_head {
            let acts = recorded()?;
            let one = ModelIdentity { n_kv_heads: 1, ..id.clone() };
            let b = bar(heads as u64, &format!("{m}: a codebook per head"));
            let per_head = (0..heads)
                .map(|h| {
                    let acts = one_head(acts, h, heads, hd);
                    let c = calibrate_for(&one, &acts, cal.keys, cal.values, want.seed, &mut |_| {})?;
                    b.inc(1);
                    Ok(c)
                })
                .collect::<Result<Vec<_>>>()?;
            b.finish();
            out.push(Candidate {
                label: format!("sim:{m}/per-head"),
                description: format!("{} with a codebook per kv head (simulated)", m.describe(hd)),
                simulation: Simulation::per_head(cal, &per_head)?,
            });
        }
        if want.residual {
            out.push(residual_candidate(id, recorded()?, m, cal, want.seed)?);
        }
        let by_mass = want
            .value_mass
            .iter()
            .zip(saved_mass)
            .map(|(&f, saved)| {
                let values = match saved {
                    Some(books) => books.values,
                    None => {
                        let values = value_mass_books(id, recorded()?, &masses, m, cal, f, want.seed)?;
                        let keys = cal.layers.iter().map(|l| l.keys.clone()).collect();
                        save(cal, &mass_name(f), &Books { keys, values: values.clone(), vectors: Vec::new() })?;
                        values
                    }
                };
                value_mass_candidate(m, cal, f, values, hd)
            })
            .collect::<Result<Vec<_>>>()?;
        for (&pairs, saved) in want.turning_keys.iter().zip(saved_turning) {
            let keys = match saved {
                Some(books) => turning_from(model, cal, books)?,
                None => {
                    let keys = turning_keys(model, recorded()?, window, m, cal, pairs, want.seed)?;
                    let books = Books {
                        keys: keys.iter().map(|k| k.shifted.clone()).collect(),
                        values: cal.layers.iter().map(|l| l.values.clone()).collect(),
                        vectors: keys.iter().map(|k| k.mean.clone()).collect(),
                    };
                    save(cal, &turning_name(pairs), &books)?;
                    keys
                }
            };
            let tag = match pairs < hd / 2 {
                true => format!("turning-keys{pairs}"),
                false => "turning-keys".to_string(),
            };
            let what = format!("keys around their turning means ({} RoPE pairs a head)", pairs.min(hd / 2));
            // The best together: each set of value books by mass read with these keys.
            for c in &by_mass {
                let mut simulation = c.simulation.clone();
                simulation.set_turning_keys(keys.clone())?;
                out.push(Candidate {
                    label: format!("{}+{tag}", c.label),
                    description: format!("{}; {what}", c.description),
                    simulation,
                });
            }
            let mut simulation = Simulation::new(cal, Sides::Both, None, None)?;
            simulation.set_turning_keys(keys)?;
            out.push(Candidate {
                label: format!("sim:{m}/{tag}"),
                description: format!(
                    "{} with {what}, or as they are, the closer per row (a flag bit; simulated)",
                    m.describe(hd)
                ),
                simulation,
            });
        }
        out.extend(by_mass);
    }
    Ok(out)
}

/// The book-cache name of value books with `by_mass` of their rows drawn by attention mass.
fn mass_name(by_mass: f64) -> String {
    format!("value-mass{}", by_mass * 100.0)
}

/// The book-cache name of turning-key books keeping `pairs` RoPE pairs a head.
fn turning_name(pairs: usize) -> String {
    format!("turning{pairs}")
}

/// Turning keys from saved books: the shifted key books and pre-RoPE means per layer, `cal`'s own
/// key books beside them, the model's RoPE.
fn turning_from(model: &Model, cal: &Calibration, books: Books) -> Result<Vec<TurningKeys>> {
    if books.keys.len() != cal.layers.len() || books.vectors.len() != cal.layers.len() {
        bail!(
            "saved turning keys: {} books and {} means for {} layers",
            books.keys.len(),
            books.vectors.len(),
            cal.layers.len()
        );
    }
    books
        .keys
        .into_iter()
        .zip(books.vectors)
        .zip(&cal.layers)
        .enumerate()
        .map(|(l, ((shifted, mean), c))| {
            Ok(TurningKeys { base: c.keys.clone(), shifted, mean, rope: Rope::of(model, l)? })
        })
        .collect()
}

/// Issue 34's pre-RoPE keys ([`turning`](crate::turning)) for `m`, per layer: its key books
/// trained again (as `calibrate` trains them, same seeds) on the calibration text's keys minus
/// their pre-RoPE mean turned to each position (only its `pairs` largest RoPE pairs per kv head),
/// beside its own.
pub fn turning_keys(
    model: &Model,
    acts: &Activations,
    window: usize,
    m: &Method,
    cal: &Calibration,
    pairs: usize,
    seed: u64,
) -> Result<Vec<TurningKeys>> {
    let id = &model.info.identity;
    let (heads, hd) = (id.n_kv_heads, id.head_dim);
    let b = bar(acts.layers.len() as u64, &format!("{m}: keys around their turning means"));
    let keys = acts
        .layers
        .iter()
        .zip(&cal.layers)
        .enumerate()
        .map(|(l, (a, c))| {
            let rope = Rope::of(model, l)?;
            let mut mean = pre_rope_mean(&a.keys, heads, window, &rope);
            rope.keep_largest_pairs(&mut mean, pairs);
            let rows = turning::shifted(&a.keys, &mean, heads, &rope, |t| t % window);
            let cfg = KMeansConfig::new(cal.keys.shape.centroids(), seed.wrapping_add(1000 * l as u64));
            let ms = a.query_ms(heads, hd);
            let (shifted, _) =
                train_codec_with_progress(&rows, heads, hd, &cal.keys, &cfg, ms.as_deref(), &|_, _, _| {})?;
            b.inc(1);
            Ok(TurningKeys { base: c.keys.clone(), shifted, mean, rope })
        })
        .collect::<Result<Vec<_>>>()?;
    b.finish();
    Ok(keys)
}

/// Issue 34's "residual / additive second stages (a 2-stage code over 8 channels is still 2
/// bits)": `m`'s code shape over twice the channels (`vq-2`'s 8-bit codes of 4 channels become
/// two 8-bit codes of 8), the first stage trained as `calibrate` trains a layer and the second on
/// what the first leaves of the same rows; keys and values both, the bits `m`'s.
pub fn residual_candidate(
    id: &ModelIdentity,
    acts: &Activations,
    m: &Method,
    cal: &Calibration,
    seed: u64,
) -> Result<Candidate> {
    let wide = |s: CodecSpec| -> Result<CodecSpec> {
        let sub_dim = s.shape.sub_dim * 2;
        let shape = PqShape::new(sub_dim, s.shape.bits)
            .map_err(|e| anyhow::anyhow!("--residual: {m} over {sub_dim} channels: {e}"))?;
        Ok(CodecSpec { shape, ..s })
    };
    let (k, v) = (wide(cal.keys)?, wide(cal.values)?);
    let b = bar(2 * id.n_layers as u64, &format!("{m}: two residual stages"));
    let first = calibrate_for(id, acts, k, v, seed, &mut |n| b.set_position(n as u64))?;
    let rest = |x: &[f32], c: &VecInferCodec| -> Result<Vec<f32>> {
        Ok(x.iter().zip(round_trip(c, x)?).map(|(a, r)| a - r).collect())
    };
    let layers = acts
        .layers
        .iter()
        .zip(&first.layers)
        .map(|(a, l)| {
            Ok(LayerActivations {
                keys: rest(&a.keys, &l.keys)?,
                values: rest(&a.values, &l.values)?,
                scale: a.scale,
                query_sq: a.query_sq.clone(),
                query_rows: a.query_rows,
                ..Default::default()
            })
        })
        .collect::<Result<_>>()?;
    let left = Activations { layers, text: acts.text.clone() };
    let n = id.n_layers as u64;
    let second = calibrate_for(id, &left, k, v, seed.wrapping_add(1), &mut |i| b.set_position(n + i as u64))?;
    b.finish();
    let hd = id.head_dim;
    Ok(Candidate {
        label: format!("sim:{m}/residual"),
        description: format!(
            "{} as two residual stages of {}-bit codes over {} channels each, keys and values (simulated)",
            m.describe(hd),
            k.shape.bits,
            k.shape.sub_dim
        ),
        simulation: Simulation::residual(&first, &second)?,
    })
}

/// Every layer's attention mass on its coded positions, sampled as `veloq calibrate
/// --value-weights attention` samples it ([`attention_sampling`], [`coded_mass`]).
fn value_masses(model: &Model, acts: &Activations, window: usize) -> Result<Vec<Vec<f64>>> {
    let b = bar(acts.layers.len() as u64, "attention mass");
    let out = acts
        .layers
        .iter()
        .map(|a| {
            let m = coded_mass(&model.info.identity, a, attention_sampling(window))?;
            b.inc(1);
            Ok(m)
        })
        .collect::<Result<_>>();
    b.finish();
    out
}

/// Issue 34's "value codebooks trained with attention-mass weights": `m`'s value books trained
/// (as `calibrate` trains them, same seeds) on rows drawn by [`value_weights::draw_rows`], a
/// fraction `by_mass` of them in proportion to the attention each coded position received on the
/// calibration text (`masses`, per layer).
pub fn value_mass_books(
    id: &ModelIdentity,
    acts: &Activations,
    masses: &[Vec<f64>],
    m: &Method,
    cal: &Calibration,
    by_mass: f64,
    seed: u64,
) -> Result<Vec<VecInferCodec>> {
    let (nkv, hd) = (id.n_kv_heads, id.head_dim);
    let b = bar(id.n_layers as u64, &format!("{m}: value books by attention mass"));
    let values = acts
        .layers
        .iter()
        .zip(masses)
        .enumerate()
        .map(|(i, (a, mass))| {
            let rows = value_weights::draw_rows(&a.values, mass, nkv, hd, by_mass, 0.5)?;
            let cfg = KMeansConfig::new(cal.values.shape.centroids(), seed.wrapping_add(1000 * i as u64 + 500));
            let ms = a.query_ms(nkv, hd);
            let (codec, _) =
                train_codec_with_progress(&rows, nkv, hd, &cal.values, &cfg, ms.as_deref(), &|_, _, _| {})?;
            b.inc(1);
            Ok(codec)
        })
        .collect::<Result<Vec<_>>>()?;
    b.finish();
    Ok(values)
}

/// `m` simulated with value books by attention mass ([`value_mass_books`]) and its own keys.
fn value_mass_candidate(
    m: &Method,
    cal: &Calibration,
    by_mass: f64,
    values: Vec<VecInferCodec>,
    hd: usize,
) -> Result<Candidate> {
    Ok(Candidate {
        label: format!("sim:{m}/{}%", mass_name(by_mass)),
        description: format!(
            "{} with value books trained on rows {}% drawn by the attention they receive while coded (simulated)",
            m.describe(hd),
            by_mass * 100.0
        ),
        simulation: Simulation::with_values(cal, values)?,
    })
}

/// Kv head `h`'s share of `acts` (of `heads`): its keys and values, and its query group's squared
/// sums (the smoothing some methods calibrate from).
fn one_head(acts: &Activations, h: usize, heads: usize, hd: usize) -> Activations {
    let pick =
        |x: &[f32]| -> Vec<f32> { x.chunks(heads * hd).flat_map(|t| t[h * hd..(h + 1) * hd].to_vec()).collect() };
    let layers = acts
        .layers
        .iter()
        .map(|a| {
            let group = a.query_sq.len() / hd / heads;
            LayerActivations {
                keys: pick(&a.keys),
                values: pick(&a.values),
                scale: a.scale,
                query_sq: a.query_sq[h * group * hd..(h + 1) * group * hd].to_vec(),
                query_rows: a.query_rows,
                ..Default::default()
            }
        })
        .collect();
    Activations { layers, text: acts.text.clone() }
}

/// `--key-heads`: issue 34's "extra bits where they matter", by kv head.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KeyHeads {
    /// Fractions of the model's (layer, kv head)s whose keys take the high precision.
    pub fractions: Vec<f64>,
    /// Also the same counts of heads drawn at random (the ranking's control).
    pub random: bool,
    /// The random draw's seed.
    pub seed: u64,
}

/// For the calibrated VecInfer methods in `chosen`: the one with the most key bits lends its key
/// codecs to each with fewer, for the fraction of (layer, kv head)s whose attention those keys
/// distort most at the low precision against the high one ([`key_heads::head_distortion`] on
/// the calibration text's own queries, recorded again in `window`-position passes); values stay
/// the low method's.
pub fn key_head_candidates(
    model: &Model,
    calib: &[u32],
    window: usize,
    chosen: &[Method],
    cals: &[Option<Calibration>],
    want: &KeyHeads,
) -> Result<Vec<Candidate>> {
    if want.fractions.is_empty() {
        return Ok(Vec::new());
    }
    if let Some(f) = want.fractions.iter().find(|f| !(0.0..=1.0).contains(*f)) {
        bail!("--key-heads {f}: a fraction of the kv heads, from 0 to 1");
    }
    let coded: Vec<(&Method, &Calibration)> =
        chosen.iter().zip(cals).filter_map(|(m, c)| Some((m, c.as_ref()?))).collect();
    let key_bits = |c: &Calibration| c.keys.shape.bits_per_element();
    let Some(&(hm, high)) = coded.iter().max_by(|a, b| key_bits(a.1).total_cmp(&key_bits(b.1))) else {
        bail!("--key-heads needs two VecInfer methods: the low one and the one whose key codecs it borrows");
    };
    let lows: Vec<_> = coded.iter().filter(|(_, c)| key_bits(c) < key_bits(high)).collect();
    if lows.is_empty() {
        bail!("--key-heads: no method with fewer key bits than {hm} to upgrade");
    }
    let b = bar(calib.len() as u64, "recording queries");
    let acts = record(model, calib, window, Queries::All, &mut |n| b.set_position(n as u64))?;
    b.finish();
    let id = &model.info.identity;
    let (hd, nkv) = (id.head_dim, id.n_kv_heads);
    let heads = Heads { q: model.info.n_heads, kv: nkv, dim: hd };
    let rows = WindowConfig::default();
    let at =
        key_heads::Sampling { window, stride: 64, skip: 256.min(window / 2), sink: rows.sink, recent: rows.window };
    let mut out = Vec::new();
    for &&(lm, low) in &lows {
        let b = bar(id.n_layers as u64, &format!("{lm}: key distortion per head"));
        let gain = acts
            .layers
            .iter()
            .zip(low.layers.iter().zip(&high.layers))
            .map(|(a, (l, h))| {
                let (lo, hi) = (round_trip(&l.keys, &a.keys)?, round_trip(&h.keys, &a.keys)?);
                let d = key_heads::head_distortion(&key_heads::LayerKeys { acts: a, low: &lo, high: &hi }, heads, at);
                b.inc(1);
                Ok(d.iter().map(|(l, h)| l - h).collect())
            })
            .collect::<Result<Vec<Vec<f64>>>>()?;
        b.finish();
        let total = gain.len() * nkv;
        for &f in &want.fractions {
            let count = (f * total as f64).round() as usize;
            let pct = 100.0 * count as f64 / total.max(1) as f64;
            let mut masks = vec![("", key_heads::upgrade_mask(&gain, count))];
            if want.random {
                masks.push(("/random", key_heads::random_mask(&vec![nkv; gain.len()], count, want.seed)));
            }
            for (tag, mask) in masks {
                let how = if tag.is_empty() {
                    "whose attention its keys distort most on the calibration text"
                } else {
                    "drawn at random"
                };
                out.push(Candidate {
                    label: format!("sim:{lm}+{hm}-keys{pct:.0}%{tag}"),
                    description: format!(
                        "{} with {hm}'s key codecs on {count} of {total} kv heads ({pct:.0}%), those {how} (simulated)",
                        lm.describe(hd)
                    ),
                    simulation: Simulation::upgraded_key_heads(low, high, &mask)?,
                });
            }
        }
    }
    Ok(out)
}

/// Issue 34's "second precision read only at the top-scoring positions" (`--rescore`,
/// `--rescore-keys`): every calibrated VecInfer method in `chosen` simulated with attention that
/// scores every coded position through its codes and then reads the exact key and value (or key
/// only) of the `top` best ones per query head ([`Simulation::set_rescore`]), once per reread.
pub fn rescore_candidates(
    chosen: &[Method],
    cals: &[Option<Calibration>],
    rereads: &[Reread],
    hd: usize,
) -> Result<Vec<Candidate>> {
    let mut out = Vec::new();
    for (m, cal) in chosen.iter().zip(cals) {
        let Some(cal) = cal else { continue };
        for &reread in rereads {
            let mut simulation = Simulation::new(cal, Sides::Both, None, None)?;
            simulation.set_rescore(reread);
            out.push(Candidate {
                label: format!("sim:{m}{}", rescore_name(reread)),
                description: format!(
                    "{}; {} (simulated; the exact copy not counted)",
                    m.describe(hd),
                    rescore_says(reread)
                ),
                simulation,
            });
        }
    }
    Ok(out)
}

/// A rescoring candidate's label suffix: `+top16`, keys only `+top16keys`.
pub fn rescore_name(reread: Reread) -> String {
    match reread.values {
        true => format!("+top{}", reread.top),
        false => format!("+top{}keys", reread.top),
    }
}

/// What a rescoring candidate reads, in words.
pub fn rescore_says(reread: Reread) -> String {
    let what = if reread.values { "keys and values" } else { "keys (values stay coded)" };
    format!("attention reads the exact {what} of the {} best-scoring coded positions per query head", reread.top)
}

/// `--f16-rows`: every coded method and candidate keeps `rows` (sinks and recent positions) in
/// f16 instead of its default, and its label says so (`vq-2+f16:64/256`); fp16 is left alone.
pub fn set_f16_rows(rows: Option<WindowConfig>, methods: &mut [(String, CacheConfig)], candidates: &mut [Candidate]) {
    let Some(rows) = rows else { return };
    let suffix = format!("+f16:{rows}");
    for (label, cfg) in methods.iter_mut().filter(|(_, c)| c.method != Method::Fp16) {
        cfg.window = rows;
        label.push_str(&suffix);
    }
    for c in candidates {
        c.simulation.set_window(rows);
        c.label.push_str(&suffix);
        c.description.push_str(&format!(", {} sink and {} recent positions in f16", rows.sink, rows.window));
    }
}

#[cfg(test)]
mod tests {
    /// Turning keys and value books by attention mass read back from the book cache code exactly
    /// as the books trained in the run, and as books trained with no cache at all; a second run
    /// records and trains nothing.
    #[test]
    fn candidate_books_from_the_cache_code_as_trained_ones() {
        use crate::book_cache::BookCache;
        use crate::probe::KeyCoder;
        use veloq::codec::vecinfer::CodecSpec;
        let model = crate::testing::tiny_model(32, 64);
        let mut rng = crate::synthetic::Rng(crate::testing::fresh_seed() | 1);
        let calib: Vec<u32> = (0..128).map(|_| (rng.uniform() * 32.0) as u32).collect();
        let window = 64;
        let acts = record(&model, &calib, window, Queries::Skip, &mut |_| {}).unwrap();
        let (ks, vs) = (CodecSpec::keys(PqShape::new(4, 4).unwrap()), CodecSpec::values(PqShape::new(4, 4).unwrap()));
        let cal = calibrate_for(&model.info.identity, &acts, ks, vs, 0, &mut |_| {}).unwrap();
        let cal = cal.with_text(TextFingerprint::of_tokens(&calib));
        let m: Method = "vq-2".parse().unwrap();
        let dir = std::env::temp_dir().join(format!("veloq-candidate-books-{}", crate::testing::fresh_seed()));
        let want = |books: Option<BookCache>| RecordedCandidates {
            value_mass: vec![1.0],
            turning_keys: vec![4],
            books,
            ..Default::default()
        };
        let cache = || Some(BookCache::new(&dir, Path::new("/models/tiny.gguf")).unwrap());
        let build = |text: &[u32], w: &RecordedCandidates| {
            recorded_candidates(&model, text, window, &[m], &[Some(cal.clone())], w)
        };
        let trained = build(&calib, &want(cache())).unwrap();
        let saved = std::fs::read_dir(dir.join("eval")).unwrap().count();
        assert_eq!(saved, 3, "value books, turning books and their means");
        // Tokens past the vocabulary cannot be recorded: a run given them succeeds only by
        // reading every book from the cache.
        let unreadable = vec![1000u32; 128];
        assert!(record(&model, &unreadable, window, Queries::Skip, &mut |_| {}).is_err());
        let read = build(&unreadable, &want(cache())).unwrap();
        let uncached = build(&calib, &want(None)).unwrap();
        let labels = |c: &[Candidate]| c.iter().map(|c| c.label.clone()).collect::<Vec<_>>();
        assert_eq!(labels(&trained).len(), 3, "mass, turning, and the two together");
        assert_eq!(labels(&read), labels(&trained));
        assert_eq!(labels(&uncached), labels(&trained));
        let d = model.info.identity.n_kv_heads * model.info.identity.head_dim;
        let rows: Vec<f32> = (0..16 * d).map(|_| rng.normal()).collect();
        for ((a, b), c) in trained.iter().zip(&read).zip(&uncached) {
            for l in 0..cal.layers.len() {
                let keys = a.simulation.reconstruct(l, &rows).unwrap();
                assert_eq!(b.simulation.reconstruct(l, &rows).unwrap(), keys, "{} keys, layer {l}", a.label);
                assert_eq!(c.simulation.reconstruct(l, &rows).unwrap(), keys, "{} keys, layer {l}", a.label);
                let values = a.simulation.reconstruct_values(l, &rows).unwrap();
                assert_eq!(b.simulation.reconstruct_values(l, &rows).unwrap(), values, "{} values", a.label);
                assert_eq!(c.simulation.reconstruct_values(l, &rows).unwrap(), values, "{} values", a.label);
            }
        }
        // The candidates differ from the method itself: the books are the candidates' own.
        let plain = Simulation::new(&cal, Sides::Both, None, None).unwrap();
        let turning = trained.iter().find(|c| c.label.ends_with("/turning-keys4")).unwrap();
        assert_ne!(turning.simulation.reconstruct(0, &rows).unwrap(), plain.reconstruct(0, &rows).unwrap());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    use super::*;

    #[test]
    fn f16_rows_reach_every_coded_method_and_its_label_but_not_fp16() {
        let rows: WindowConfig = "64/256".parse().unwrap();
        let mut methods: Vec<(String, CacheConfig)> = ["fp16", "kivi-2", "rlm-4"]
            .iter()
            .map(|m| (m.to_string(), config(m.parse().unwrap(), None).unwrap()))
            .collect();
        set_f16_rows(None, &mut methods, &mut []);
        assert!(methods.iter().all(|(l, c)| !l.contains("f16:") && c.window == WindowConfig::default()));
        set_f16_rows(Some(rows), &mut methods, &mut []);
        assert_eq!((methods[0].0.as_str(), methods[0].1.window), ("fp16", WindowConfig::default()));
        for (label, cfg) in &methods[1..] {
            assert!(label.ends_with("+f16:64/256"), "{label}");
            assert_eq!(cfg.window, rows);
        }
    }
}
