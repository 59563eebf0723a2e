//! Attention pieces shared by the caches: the dense prefill path (candle ops, so it runs on any
//! device and uses candle's matmul), and the small f32 helpers of the CPU decode loops.

use candle_core::{DType, Device, Tensor};
use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::error::Result;

/// Causal GQA attention of `q` (`[1, Hq, T, D]`) over `s` positions of f32 keys/values given
/// token-major (`[S, Hkv, D]`). Query heads are grouped onto their kv head by reshaping the
/// queries (`[Hkv, G·T, D]`), never by copying keys.
pub fn attend_dense(q: &Tensor, k: Vec<f32>, v: Vec<f32>, n_kv: usize, scale: f64) -> Result<Tensor> {
    attend_dense_window(q, k, v, n_kv, scale, None)
}

/// [`attend_dense`] where each query also sees at most the `window` most recent positions
/// (itself included), as in sliding-window layers.
pub fn attend_dense_window(q: &Tensor, k: Vec<f32>, v: Vec<f32>, n_kv: usize, scale: f64, window: Option<usize>) -> Result<Tensor> {
    let (_, hq, t, d) = q.dims4()?;
    let s = k.len() / (n_kv * d);
    let g = hq / n_kv;
    let dev = q.device();
    let kt = Tensor::from_vec(k, (s, n_kv, d), dev)?.transpose(0, 1)?.contiguous()?; // [Hkv, S, D]
    let vt = Tensor::from_vec(v, (s, n_kv, d), dev)?.transpose(0, 1)?.contiguous()?;
    let qg = q.to_dtype(DType::F32)?.reshape((n_kv, g * t, d))?;
    let att = (qg.matmul(&kt.t()?)? * scale)?; // [Hkv, G·T, S]
    let masked = t > 1 || window.is_some_and(|w| s > w);
    let att = if masked { att.broadcast_add(&causal_mask(t, s, g, window, dev)?)? } else { att };
    let p = candle_nn::ops::softmax_last_dim(&att)?;
    Ok(p.matmul(&vt)?.reshape((1, hq, t, d))?)
}

/// `[G·T, S]` additive mask: row (g, i) sees positions `0..=S − T + i`, and with a window only
/// the last `window` of them.
fn causal_mask(t: usize, s: usize, g: usize, window: Option<usize>, dev: &Device) -> Result<Tensor> {
    let off = s - t;
    let mut m = vec![0.0f32; g * t * s];
    for gi in 0..g {
        for i in 0..t {
            let row = &mut m[(gi * t + i) * s..(gi * t + i + 1) * s];
            let first = window.map_or(0, |w| (off + i + 1).saturating_sub(w));
            row[..first].fill(f32::NEG_INFINITY);
            row[off + i + 1..].fill(f32::NEG_INFINITY);
        }
    }
    Ok(Tensor::from_vec(m, (g * t, s), dev)?)
}

/// Dot product with 8 independent accumulators (vectorises without reassociation flags).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// out += w · x
#[inline]
pub fn axpy(w: f32, x: &[f32], out: &mut [f32]) {
    for (o, v) in out.iter_mut().zip(x) {
        *o += w * v;
    }
}

/// Widens f16 to f32 (F16C where the CPU has it).
#[inline]
pub fn widen(src: &[f16], dst: &mut [f32]) {
    src.convert_to_f32_slice(dst);
}

/// In-place softmax; returns nothing, leaves probabilities summing to 1.
pub fn softmax(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// Queries `[1, Hq, 1, D]` as rows of f32.
pub fn query_rows(q: &Tensor) -> Result<Vec<f32>> {
    Ok(q.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

pub fn output(rows: Vec<f32>, hq: usize, d: usize, dev: &Device) -> Result<Tensor> {
    Ok(Tensor::from_vec(rows, (1, hq, 1, d), dev)?)
}

