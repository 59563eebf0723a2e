//! Calibration: from activations collected on real text to a trained codec.

pub mod fingerprint;
pub mod kmeans;
pub mod value_weights;

pub use fingerprint::TextFingerprint;
pub use kmeans::{kmeans, KMeansConfig, KMeansReport};
pub use value_weights::ValueWeights;

use crate::codec::codebook::{CodebookSet, Granularity};
use crate::codec::smooth::SmoothScales;
use crate::codec::transform::RowTransform;
use crate::codec::vecinfer::{CodecSpec, VecInferCodec};
use crate::error::{Error, Result};

/// Trains a codec for one layer's keys or values from `samples` (`[tokens, n_heads, head_dim]`):
/// smoothing scales from the samples, then k-means on the smoothed, rotated sub-vectors (pooled
/// for a per-layer codebook, one run per sub-space otherwise; sub-space `j` uses seed + j).
pub fn train_codec(
    samples: &[f32],
    n_heads: usize,
    head_dim: usize,
    spec: &CodecSpec,
    kmeans_cfg: &KMeansConfig,
) -> Result<(VecInferCodec, Vec<KMeansReport>)> {
    train_codec_with_progress(samples, n_heads, head_dim, spec, kmeans_cfg, None, &|_, _, _| {})
}

/// [`train_codec`] reporting `(codebook, iteration, mse)` after each Lloyd assignment.
/// `query_ms`, the mean square of the queries per (head, channel) `[n_heads, head_dim]`, is needed
/// by [`SmoothRule::QueryRms`](crate::codec::smooth::SmoothRule::QueryRms) smoothing.
pub fn train_codec_with_progress(
    samples: &[f32],
    n_heads: usize,
    head_dim: usize,
    spec: &CodecSpec,
    kmeans_cfg: &KMeansConfig,
    query_ms: Option<&[f32]>,
    progress: &(dyn Fn(usize, usize, f64) + Sync),
) -> Result<(VecInferCodec, Vec<KMeansReport>)> {
    if kmeans_cfg.k != spec.shape.centroids() {
        return Err(Error::Config(format!(
            "k-means k = {} but codebook has {} centroids",
            kmeans_cfg.k,
            spec.shape.centroids()
        )));
    }
    let row = n_heads * head_dim;
    if row == 0 || !samples.len().is_multiple_of(row) || samples.is_empty() {
        return Err(Error::Shape(format!(
            "calibration samples: {} values are not whole [tokens, {n_heads}, {head_dim}] rows",
            samples.len()
        )));
    }
    let mean = spec.center.then(|| channel_means(samples, row));
    let smooth = match spec.smooth {
        Some(rule) if rule.needs_queries() => {
            let ms = query_ms
                .ok_or_else(|| Error::Config(format!("{} smoothing needs the queries' second moments", rule.name())))?;
            Some(SmoothScales::from_queries(ms, n_heads, head_dim)?)
        }
        Some(rule) => {
            let centered: Vec<f32> = match &mean {
                Some(mu) => samples.iter().enumerate().map(|(i, x)| x - mu[i % row]).collect(),
                None => samples.to_vec(),
            };
            Some(SmoothScales::calibrate(&centered, n_heads, head_dim, rule)?)
        }
        None => None,
    };
    let m = spec.shape.subspaces(head_dim)?;
    let transform = RowTransform::new(n_heads, head_dim, mean.clone(), smooth.clone(), spec.rotate)?;
    let mut transformed = vec![0.0f32; samples.len()];
    for (r, (src, dst)) in samples.chunks_exact(head_dim).zip(transformed.chunks_exact_mut(head_dim)).enumerate() {
        transform.forward(r % n_heads, src, dst);
    }
    let sd = spec.shape.sub_dim;
    let (books, reports) = match spec.granularity {
        Granularity::PerLayer => {
            let (b, r) = kmeans(&transformed, sd, kmeans_cfg, &|i, e| progress(0, i, e))?;
            (vec![b], vec![r])
        }
        Granularity::PerSubspace => {
            let mut books = Vec::with_capacity(m);
            let mut reports = Vec::with_capacity(m);
            for j in 0..m {
                let sub: Vec<f32> = transformed
                    .chunks_exact(head_dim)
                    .flat_map(|row| row[j * sd..(j + 1) * sd].iter().copied())
                    .collect();
                let cfg = KMeansConfig { seed: kmeans_cfg.seed.wrapping_add(j as u64), ..kmeans_cfg.clone() };
                let (b, r) = kmeans(&sub, sd, &cfg, &|i, e| progress(j, i, e))?;
                books.push(b);
                reports.push(r);
            }
            (books, reports)
        }
    };
    let books = CodebookSet::new(spec.shape, spec.granularity, m, books)?;
    Ok((VecInferCodec::new(n_heads, head_dim, mean, smooth, spec.rotate, books)?, reports))
}

/// Per-(head, channel) means of token-major rows, summed in f64.
fn channel_means(samples: &[f32], row: usize) -> Vec<f32> {
    let mut sum = vec![0.0f64; row];
    for r in samples.chunks_exact(row) {
        sum.iter_mut().zip(r).for_each(|(s, &x)| *s += x as f64);
    }
    let n = (samples.len() / row) as f64;
    sum.into_iter().map(|s| (s / n) as f32).collect()
}
