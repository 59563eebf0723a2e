//! Calibration on the model's own activations: run real text through the model with caches that
//! record every layer's post-RoPE keys and values, then train each layer's codecs.

use std::sync::{Arc, Mutex};

use candle_core::Tensor;

use veloq::artifact::{Calibration, LayerCodecs, ModelIdentity};
use veloq::calibrate::value_weights::{self, AttentionRows, QuerySampling};
use veloq::calibrate::{train_codec_with_progress, KMeansConfig, TextFingerprint, ValueWeights};
use veloq::codec::vecinfer::CodecSpec;

use crate::cache::{LayerCache, ModelCache, Step};
use crate::config::{CacheConfig, WindowConfig};
use crate::error::{Error, Result};
use crate::method::Vq;
use crate::model::{encode, Logits, Model, Tokenizer};

/// Every layer's activations over some text, and that text's fingerprint (which the calibration
/// carries, so evaluation can refuse to score on it).
pub struct Activations {
    /// Per layer, in layer order.
    pub layers: Vec<LayerActivations>,
    /// Shingles of the text, so evaluation can refuse to score on it.
    pub text: TextFingerprint,
}

/// Keys and values of one layer, token-major `[tokens, n_kv_heads, head_dim]`; queries when asked
/// for ([`Queries`]: every position's for the lab's probes, the sampled ones for attention
/// weights), and the attention scale the model used.
#[derive(Default)]
pub struct LayerActivations {
    /// Keys `[tokens, kv heads, head_dim]`, post-RoPE.
    pub keys: Vec<f32>,
    /// Values `[tokens, kv heads, head_dim]`.
    pub values: Vec<f32>,
    /// Queries `[tokens, heads, head_dim]` when recorded ([`Queries::All`]); only the sampled
    /// positions' rows, `[sampled, heads, head_dim]`, when `sampled` says where.
    pub queries: Vec<f32>,
    /// Where the queries were sampled ([`Queries::Sampled`]); `None` when all or none were kept.
    pub sampled: Option<QuerySampling>,
    /// The attention scale the layer used.
    pub scale: f32,
    /// Sum of squared queries per (query head, channel) and the query rows summed: always kept
    /// (query-weighted smoothing calibrates from them), cheap next to the keys.
    pub query_sq: Vec<f64>,
    /// Query rows summed into `query_sq`.
    pub query_rows: usize,
}

impl LayerActivations {
    /// Mean square of the queries per (kv head, channel), pooled over each kv head's query group.
    pub fn query_ms(&self, n_kv_heads: usize, head_dim: usize) -> Option<Vec<f32>> {
        let nh = self.query_sq.len() / head_dim.max(1);
        if self.query_rows == 0 || nh == 0 || !nh.is_multiple_of(n_kv_heads) {
            return None;
        }
        let group = nh / n_kv_heads;
        let mut ms = vec![0.0f64; n_kv_heads * head_dim];
        for (h, row) in self.query_sq.chunks_exact(head_dim).enumerate() {
            let kv = h / group;
            ms[kv * head_dim..(kv + 1) * head_dim].iter_mut().zip(row).for_each(|(m, s)| *m += s);
        }
        let n = (self.query_rows * group) as f64;
        Some(ms.into_iter().map(|m| (m / n) as f32).collect())
    }
}

/// Which queries [`record`] keeps besides their second moments (which it always sums).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Queries {
    /// None: keys and values only.
    Skip,
    /// Every position's (4 bytes per element of every query head: the lab's probes).
    All,
    /// Only the positions a [`QuerySampling`] scores, whose window must be the recording's: what
    /// [`coded_mass`] reads, an eighth of the queries at [`attention_sampling`]'s stride.
    Sampled(QuerySampling),
}

impl Queries {
    /// What calibrating value books weighted by `weights` over passes of `window` positions reads.
    pub fn for_weights(weights: ValueWeights, window: usize) -> Self {
        match weights {
            ValueWeights::Attention => Queries::Sampled(attention_sampling(window)),
            ValueWeights::Uniform => Queries::Skip,
        }
    }
}

/// An fp16 cache (fresh for each pass) that also copies everything appended to it, and the queries
/// `queries` asks for, into a shared sink.
struct Recorder {
    inner: Box<dyn LayerCache>,
    sink: Arc<Mutex<LayerActivations>>,
    queries: Queries,
}

fn rows(x: &Tensor) -> Result<Vec<f32>> {
    Ok(x.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

impl LayerCache for Recorder {
    fn append(&mut self, k: &Tensor, v: &Tensor, step: &Step) -> Result<()> {
        let (kr, vr) = (rows(k)?, rows(v)?);
        let mut s = self.sink.lock().expect("recorder lock");
        s.keys.extend(kr);
        s.values.extend(vr);
        drop(s);
        self.inner.append(k, v, step)
    }
    fn attend(&self, q: &Tensor, step: &Step, scale: f32) -> Result<Tensor> {
        let (tokens, heads, dim) = q.dims3()?;
        let qr = rows(q)?;
        let mut s = self.sink.lock().expect("recorder lock");
        s.scale = scale;
        if s.query_sq.is_empty() {
            s.query_sq = vec![0.0; heads * dim];
        }
        for row in qr.chunks_exact(heads * dim) {
            s.query_sq.iter_mut().zip(row).for_each(|(a, &x)| *a += (x as f64) * (x as f64));
        }
        s.query_rows += tokens;
        match self.queries {
            Queries::Skip => {}
            Queries::All => s.queries.extend(qr),
            // The pass's cache starts at position 0, so a step's positions are the pass's.
            Queries::Sampled(at) => {
                for (p, row) in step.positions().into_iter().zip(qr.chunks_exact(heads * dim)) {
                    if at.samples(p as usize) {
                        s.queries.extend_from_slice(row);
                    }
                }
            }
        }
        drop(s);
        self.inner.attend(q, step, scale)
    }
    fn commit(&mut self) -> Result<()> {
        self.inner.commit()
    }
    fn slots(&self) -> usize {
        self.inner.slots()
    }
    fn len(&self, slot: usize) -> usize {
        self.inner.len(slot)
    }
    fn resident_bytes(&self) -> usize {
        self.inner.resident_bytes()
    }
    fn sequence_bytes(&self, positions: usize) -> usize {
        self.inner.sequence_bytes(positions)
    }
    fn truncate(&mut self, slot: usize, len: usize) -> Result<()> {
        self.inner.truncate(slot, len)
    }
}

/// Runs `tokens` through the model in windows of `window` positions (fresh caches per window) and
/// returns every layer's keys and values, token-major `[tokens, kv heads, head_dim]`.
/// `progress(done_tokens)` after each window.
pub fn collect_activations(
    model: &Model,
    tokens: &[u32],
    window: usize,
    progress: &mut dyn FnMut(usize),
) -> Result<Activations> {
    record(model, tokens, window, Queries::Skip, progress)
}

/// [`collect_activations`], with the queries `queries` asks for too.
pub fn record(
    model: &Model,
    tokens: &[u32],
    window: usize,
    queries: Queries,
    progress: &mut dyn FnMut(usize),
) -> Result<Activations> {
    if let Queries::Sampled(at) = queries {
        if at.window != window.max(1) {
            return Err(Error::Config(format!(
                "queries sampled in passes of {} positions from a recording in passes of {window}",
                at.window
            )));
        }
    }
    let sampled = match queries {
        Queries::Sampled(at) => Some(at),
        Queries::Skip | Queries::All => None,
    };
    let sinks: Vec<_> = (0..model.info.identity.n_layers)
        .map(|_| Arc::new(Mutex::new(LayerActivations { sampled, ..Default::default() })))
        .collect();
    let mut done = 0;
    for chunk in tokens.chunks(window.max(1)) {
        let fp16 = CacheConfig { capacity: Some(chunk.len()), ..CacheConfig::fp16() }.build(model)?;
        let layers = fp16
            .into_layers()
            .into_iter()
            .zip(&sinks)
            .map(|(inner, s)| Box::new(Recorder { inner, sink: s.clone(), queries }) as Box<dyn LayerCache>)
            .collect();
        let mut caches = ModelCache::new(layers)?;
        model.forward(chunk, &mut caches, Logits::Last)?;
        done += chunk.len();
        progress(done);
    }
    let layers = sinks
        .into_iter()
        .map(|s| {
            Arc::try_unwrap(s)
                .map_err(|_| Error::Config("recorder still shared".into()))
                .map(|m| m.into_inner().expect("recorder lock"))
        })
        .collect::<Result<_>>()?;
    Ok(Activations { layers, text: TextFingerprint::of_tokens(tokens) })
}

/// Trains key and value codecs for every layer from collected activations.
pub fn calibrate(
    model: &Model,
    acts: &Activations,
    keys: CodecSpec,
    values: CodecSpec,
    seed: u64,
    progress: &mut dyn FnMut(usize),
) -> Result<Calibration> {
    calibrate_for(&model.info.identity, acts, keys, values, seed, progress)
}

/// [`calibrate`] for a model known by its identity alone (one veloq does not run: a transformers
/// model, whose activations the Python binding collects).
pub fn calibrate_for(
    id: &ModelIdentity,
    acts: &Activations,
    keys: CodecSpec,
    values: CodecSpec,
    seed: u64,
    progress: &mut dyn FnMut(usize),
) -> Result<Calibration> {
    calibrate_weighted(id, acts, keys, values, seed, None, progress)
}

/// Where [`ValueWeights::Attention`] samples the calibration text's queries in passes of
/// `window` positions: every 8th position, the cache's default residency (sink and recent rows
/// exact, the rest coded).
pub fn attention_sampling(window: usize) -> QuerySampling {
    let rows = WindowConfig::default();
    QuerySampling { window, stride: 8, skip: 0, sink: rows.sink, recent: rows.window }
}

/// Layer `a`'s attention mass per (position, kv head) on its coded positions, from its recorded
/// queries ([`value_weights::coded_mass`]): the weights of [`ValueWeights::Attention`]. Queries
/// recorded at `at` ([`Queries::Sampled`]) are read as they are; every position's are sampled.
pub fn coded_mass(id: &ModelIdentity, a: &LayerActivations, at: QuerySampling) -> Result<Vec<f64>> {
    if a.queries.is_empty() {
        return Err(Error::Config(
            "value books weighted by attention need the queries recorded (record with queries)".into(),
        ));
    }
    let tokens = a.keys.len() / (id.n_kv_heads * id.head_dim).max(1);
    let gathered;
    let queries = match a.sampled {
        Some(s) if s == at => &a.queries,
        Some(s) => return Err(Error::Config(format!("queries recorded at {s:?}, weighed at {at:?}"))),
        None => {
            gathered = at.gather(&a.queries, a.queries.len() / tokens.max(1));
            &gathered
        }
    };
    let rows = AttentionRows {
        keys: &a.keys,
        queries,
        scale: a.scale,
        heads: queries.len() / (at.queries(tokens).len() * id.head_dim).max(1),
        kv_heads: id.n_kv_heads,
        head_dim: id.head_dim,
    };
    Ok(value_weights::coded_mass(rows, at)?)
}

/// [`calibrate_for`] with the value books' rows weighed by the attention each coded position
/// receives ([`ValueWeights::Attention`]) when `by_attention` says where to sample the queries
/// (`acts` must hold them: [`record`] with queries); uniformly when `None`.
pub fn calibrate_weighted(
    id: &ModelIdentity,
    acts: &Activations,
    keys: CodecSpec,
    values: CodecSpec,
    seed: u64,
    by_attention: Option<QuerySampling>,
    progress: &mut dyn FnMut(usize),
) -> Result<Calibration> {
    if acts.layers.len() != id.n_layers {
        return Err(Error::Shape(format!(
            "activations of {} layers for a model of {}",
            acts.layers.len(),
            id.n_layers
        )));
    }
    let tokens = acts.layers.first().map_or(0, |a| a.keys.len() / (id.n_kv_heads * id.head_dim));
    let mut layers = Vec::with_capacity(acts.layers.len());
    for (i, a) in acts.layers.iter().enumerate() {
        let kcfg = KMeansConfig::new(keys.shape.centroids(), seed.wrapping_add(1000 * i as u64));
        let vcfg = KMeansConfig::new(values.shape.centroids(), seed.wrapping_add(1000 * i as u64 + 500));
        let ms = a.query_ms(id.n_kv_heads, id.head_dim);
        let train = |x: &[f32], spec: &CodecSpec, cfg: &KMeansConfig| {
            train_codec_with_progress(x, id.n_kv_heads, id.head_dim, spec, cfg, ms.as_deref(), &|_, _, _| {})
        };
        let (k, _) = train(&a.keys, &keys, &kcfg)?;
        let (v, _) = match by_attention {
            None => train(&a.values, &values, &vcfg)?,
            Some(at) => {
                let mass = coded_mass(id, a, at)?;
                train(
                    &value_weights::draw_rows(&a.values, &mass, id.n_kv_heads, id.head_dim, 1.0, 0.5)?,
                    &values,
                    &vcfg,
                )?
            }
        };
        layers.push(LayerCodecs { keys: k, values: v });
        progress(i + 1);
    }
    let weights = if by_attention.is_some() { ValueWeights::Attention } else { ValueWeights::Uniform };
    Ok(Calibration::new(id.clone(), keys, values, seed, tokens, layers)?
        .with_text(acts.text.clone())
        .with_value_weights(weights))
}

/// How [`calibrate_text`] reads its text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CalibrateOptions {
    /// Tokens of text to calibrate on (the text must have at least this many).
    pub tokens: usize,
    /// Positions per forward pass while collecting: post-RoPE keys depend on position, so at
    /// least the context the codecs will code (the model must be opened for this many).
    pub window: usize,
    /// k-means seed.
    pub seed: u64,
    /// What the value codebooks' k-means weighs rows by. `Attention` records the queries of every
    /// 8th position of a pass too (4 bytes per query element while calibrating) and scores them
    /// against the positions before them.
    pub value_weights: ValueWeights,
}

impl Default for CalibrateOptions {
    /// 8,192 tokens in one window, seed 0, uniform value weights: what `veloq calibrate` runs.
    fn default() -> Self {
        Self { tokens: 8192, window: 8192, seed: 0, value_weights: ValueWeights::Uniform }
    }
}

/// Where [`calibrate_text`] is: `Collecting` activations (tokens done of all), then k-means
/// (`Training` layers done of all).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// Tokens run through the model, of all.
    Collecting(usize, usize),
    /// Layers whose codecs are trained, of all.
    Training(usize, usize),
}

/// The calibration of VecInfer method `vq` for `model` on the first `opts.tokens` tokens of
/// `text`: what `veloq calibrate` and the Python binding's `calibrate` run.
pub fn calibrate_text(
    model: &Model,
    tok: &Tokenizer,
    text: &str,
    vq: Vq,
    opts: &CalibrateOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<Calibration> {
    let mut ids = encode(tok, text)?;
    if opts.tokens == 0 || ids.len() < opts.tokens {
        return Err(Error::Config(format!(
            "calibration needs {} tokens of text; this text has {}",
            opts.tokens,
            ids.len()
        )));
    }
    if opts.window > model.max_context() {
        return Err(Error::Config(format!(
            "a collection window of {} positions needs the model opened for that many (it is for {})",
            opts.window,
            model.max_context()
        )));
    }
    ids.truncate(opts.tokens);
    let total = ids.len();
    let queries = Queries::for_weights(opts.value_weights, opts.window);
    let acts = record(model, &ids, opts.window, queries, &mut |n| progress(Progress::Collecting(n, total)))?;
    let by_attention = (opts.value_weights == ValueWeights::Attention).then(|| attention_sampling(opts.window));
    let layers = acts.layers.len();
    let id = &model.info.identity;
    calibrate_weighted(id, &acts, vq.keys, vq.values, opts.seed, by_attention, &mut |n| {
        progress(Progress::Training(n, layers))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keeping only the sampled queries, pass by pass, gives the mass that every position's
    /// queries give (summed in another order: equal to rounding), in an eighth of the memory.
    #[test]
    fn sampled_queries_weigh_as_all_of_them() {
        let seed = crate::testing::fresh_seed();
        let model = crate::testing::tiny_model_seeded(50, 64, seed);
        let tokens: Vec<u32> = (0..150u64).map(|i| ((seed >> (i % 40)) ^ (i * 7)) as u32 % 50).collect();
        let at = QuerySampling { sink: 2, recent: 5, ..attention_sampling(64) };
        let all = record(&model, &tokens, 64, Queries::All, &mut |_| {}).unwrap();
        let some = record(&model, &tokens, 64, Queries::Sampled(at), &mut |_| {}).unwrap();
        let id = &model.info.identity;
        for (a, b) in all.layers.iter().zip(&some.layers) {
            assert_eq!(a.keys, b.keys);
            assert_eq!(b.queries.len() * 150, a.queries.len() * at.queries(150).len(), "seed {seed}");
            let (ma, mb) = (coded_mass(id, a, at).unwrap(), coded_mass(id, b, at).unwrap());
            // Each of ~20 sampled queries × 4 heads hands most of its softmax to coded positions.
            assert!(ma.iter().sum::<f64>() > 1.0, "seed {seed}: some mass on coded positions");
            // The same f32 scores and softmaxes of the same rows; only the f64 sums over queries
            // run in rayon's order, so the two agree to their rounding (a few hundred terms).
            for (x, y) in ma.iter().zip(&mb) {
                assert!((x - y).abs() <= 1e-12 * x.abs().max(1.0), "seed {seed}: {x} vs {y}");
            }
            let other = QuerySampling { stride: 4, ..at };
            assert!(coded_mass(id, b, other).is_err(), "sampled elsewhere");
        }
        assert!(record(&model, &tokens, 32, Queries::Sampled(at), &mut |_| {}).is_err(), "passes of another length");
    }

    #[test]
    fn query_moments_pool_each_kv_heads_query_group() {
        // 4 query heads of 2 channels over 2 kv heads, 5 rows: heads 0,1 read kv 0; heads 2,3 kv 1.
        let a = LayerActivations {
            query_sq: vec![5.0, 10.0, 15.0, 20.0, 25.0, 30.0, 35.0, 40.0],
            query_rows: 5,
            ..Default::default()
        };
        assert_eq!(a.query_ms(2, 2).unwrap(), vec![2.0, 3.0, 6.0, 7.0]);
        assert!(a.query_ms(3, 2).is_none(), "4 query heads do not group over 3 kv heads");
        assert!(LayerActivations::default().query_ms(2, 2).is_none(), "nothing recorded");
    }
}
