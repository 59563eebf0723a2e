//! Issue 34's "second precision read only at the top-scoring positions": attention that scores
//! every coded position through its reconstruction, then reads the exact key and value of the
//! `top` coded positions that scored highest for this query head and scores those again. What a
//! cache holding codes plus a second copy it rarely reads (host memory, or a residual stage)
//! would compute; the simulation runs it in place of the fp16 cache's attention, in tensor
//! operations on the model's device (a GPU answers a full needle grid in minutes, the host in hours).

use candle_core::{DType, Device, Tensor, D};
use rayon::prelude::*;

use veloq_candle::cache::Heads;
use veloq_candle::error::{Error, Result};

/// What the rescoring attention reads again at each query head's best-scoring coded positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reread {
    /// Coded positions per (query, head) read again.
    pub top: usize,
    /// Their exact values too (else only their exact keys: the values stay coded, and the copy
    /// a cache keeps is half as large).
    pub values: bool,
}

impl Reread {
    /// Keys and values of `top` positions.
    pub fn rows(top: usize) -> Self {
        Self { top, values: true }
    }

    /// Keys only of `top` positions.
    pub fn keys(top: usize) -> Self {
        Self { top, values: false }
    }
}

/// One sequence's positions as the rescoring attention reads them, rows `[position, kv heads,
/// head_dim]` f32: positions `sink..coded` are coded (`coarse_*` holds their reconstructions, from
/// `sink` on), every other position is exact; `exact_*` holds every position exactly.
pub struct SeqRows<'a> {
    /// Every position's exact keys (at least as many as the queries see).
    pub exact_k: &'a Tensor,
    /// Every position's exact values.
    pub exact_v: &'a Tensor,
    /// Reconstructed keys of positions `sink..coded` (none while nothing is coded).
    pub coarse_k: Option<&'a Tensor>,
    /// Reconstructed values of positions `sink..coded`.
    pub coarse_v: Option<&'a Tensor>,
    /// The first coded position (the sink's end).
    pub sink: usize,
    /// The end of the coded span.
    pub coded: usize,
}

impl SeqRows<'_> {
    fn coded_span(&self) -> usize {
        self.coded.saturating_sub(self.sink)
    }

    /// One side's first `len` positions as attention reads them by default (reconstructions in
    /// the coded span), kv heads first: `[kv, len, d]`.
    fn mixed(&self, exact: &Tensor, coarse: Option<&Tensor>, len: usize) -> Result<Tensor> {
        let exact = exact.narrow(0, 0, len)?;
        let c = self.coded_span();
        let rows = match (c, coarse) {
            (0, _) => exact,
            (_, Some(coarse)) => Tensor::cat(
                &[
                    exact.narrow(0, 0, self.sink)?,
                    coarse.narrow(0, 0, c)?,
                    exact.narrow(0, self.coded, len - self.coded)?,
                ],
                0,
            )?,
            (_, None) => return Err(Error::Config("a coded span without its reconstructions".into())),
        };
        heads_first(&rows)
    }

    /// The coded span of one side's exact rows, kv heads first: `[kv, coded - sink, d]`.
    fn span(&self, exact: &Tensor) -> Result<Tensor> {
        heads_first(&exact.narrow(0, self.sink, self.coded_span())?)
    }
}

/// `[positions, kv, d]` rows as `[kv, positions, d]`.
fn heads_first(rows: &Tensor) -> Result<Tensor> {
    Ok(rows.transpose(0, 1)?.contiguous()?)
}

/// Causal attention of `q` (`[n, q heads, head_dim]`, query `t` at position `start + t`) over
/// `rows`: softmax of `scale · q·k` with coded positions scored through their reconstructions
/// except the `reread.top` best of them per (query, head), which are scored with their exact keys
/// and weighted with their exact values (or, keys only, their reconstructed ones). The coded
/// span must end at or before `start` (codes are made at a step's commit). Returns `[n, q heads,
/// head_dim]` f32.
pub fn attend(q: &Tensor, start: usize, rows: &SeqRows, heads: Heads, scale: f32, reread: Reread) -> Result<Tensor> {
    Ok(attend_choosing(q, start, rows, heads, scale, reread)?.0)
}

/// [`attend`], and the coded positions it read again: `[kv heads, g·n, coded span]` u8, 1 where
/// query `t` of the group's head `j` (row `j·n + t`) chose the span's position (from `sink` on);
/// `None` where nothing was read again (no codes, or `top` 0).
pub fn attend_choosing(
    q: &Tensor,
    start: usize,
    rows: &SeqRows,
    heads: Heads,
    scale: f32,
    reread: Reread,
) -> Result<(Tensor, Option<Tensor>)> {
    let Reread { top, values } = reread;
    let Heads { q: hq, kv, dim: d } = heads;
    let (n, g) = (q.dim(0)?, hq / kv);
    let len = start + n;
    if rows.coded_span() > 0 && rows.coded > start {
        return Err(Error::Config(format!("coded span to {} past the step's start {start}", rows.coded)));
    }
    let dev = q.device();
    // Queries grouped by their kv head: `[kv, g·n, d]`, row `j·n + t`.
    let qg =
        q.to_dtype(DType::F32)?.reshape((n, kv, g, d))?.permute((1, 2, 0, 3))?.contiguous()?.reshape((kv, g * n, d))?;
    let score = |k: &Tensor| -> Result<Tensor> { Ok((qg.matmul(&k.t()?)? * scale as f64)?) };
    let (mk, mv) = (rows.mixed(rows.exact_k, rows.coarse_k, len)?, rows.mixed(rows.exact_v, rows.coarse_v, len)?);
    let scores = score(&mk)?.broadcast_add(&causal_bias(start, n, g, dev)?)?;
    let c = rows.coded_span();
    let (out, chosen) = if c == 0 || top == 0 {
        (candle_nn::ops::softmax_last_dim(&scores)?.matmul(&mv)?, None)
    } else {
        let coarse = scores.narrow(2, rows.sink, c)?;
        let chosen = top_mask(&coarse, top)?;
        let exact = score(&rows.span(rows.exact_k)?)?;
        let span = chosen.where_cond(&exact, &coarse)?;
        let rest = len - rows.coded;
        let scores = Tensor::cat(&[scores.narrow(2, 0, rows.sink)?, span, scores.narrow(2, rows.coded, rest)?], 2)?;
        let w = candle_nn::ops::softmax_last_dim(&scores)?;
        let out = w.matmul(&mv)?;
        let out = match values {
            // The chosen positions' weights move from their reconstructed values to their exact ones.
            true => {
                let coarse_v = rows.coarse_v.ok_or_else(|| Error::Config("a coded span without its values".into()))?;
                let fix = (rows.span(rows.exact_v)? - heads_first(&coarse_v.narrow(0, 0, c)?)?)?;
                let wc = (w.narrow(2, rows.sink, c)? * chosen.to_dtype(DType::F32)?)?;
                (out + wc.matmul(&fix)?)?
            }
            false => out,
        };
        (out, Some(chosen))
    };
    let out = out.reshape((kv, g, n, d))?.permute((2, 0, 1, 3))?.contiguous()?.reshape((n, hq, d))?;
    Ok((out, chosen))
}

/// 0 where query `t` (at `start + t`) may look, −∞ past it: `[1, g·n, start + n]`, the grouped
/// queries' rows.
fn causal_bias(start: usize, n: usize, g: usize, dev: &Device) -> Result<Tensor> {
    let len = start + n;
    let pos = Tensor::arange(0u32, len as u32, dev)?.reshape((1, len))?;
    let at = Tensor::arange(start as u32, len as u32, dev)?.reshape((n, 1))?;
    let future = pos.broadcast_gt(&at)?;
    let bias = future
        .where_cond(&Tensor::full(f32::NEG_INFINITY, (n, len), dev)?, &Tensor::zeros((n, len), DType::F32, dev)?)?;
    Ok(bias.unsqueeze(0)?.broadcast_as((g, n, len))?.contiguous()?.reshape((1, g * n, len))?)
}

/// 1 at the `top` largest entries of each last-dim row of `x` (all of them when the row is no
/// longer), 0 elsewhere (exact but for ties, which may mark more).
fn top_mask(x: &Tensor, top: usize) -> Result<Tensor> {
    let cols = x.dim(D::Minus1)?;
    if top >= cols {
        return Ok(x.ones_like()?.to_dtype(DType::U8)?);
    }
    if top == 0 {
        return Ok(x.zeros_like()?.to_dtype(DType::U8)?);
    }
    let kth = match x.device().is_cpu() {
        true => kth_by_selection(x, top)?,
        false => kth_by_maxima(x, top)?,
    };
    Ok(x.broadcast_ge(&kth)?)
}

/// The `top`-th largest of each last-dim row (`1 ≤ top <` the row), kept as a last dim of 1: a
/// selection per row on the host.
fn kth_by_selection(x: &Tensor, top: usize) -> Result<Tensor> {
    let cols = x.dim(D::Minus1)?;
    let values = x.flatten_all()?.to_vec1::<f32>()?;
    let kth: Vec<f32> = values
        .par_chunks(cols)
        .map(|row| *row.to_vec().select_nth_unstable_by(top - 1, |a, b| b.total_cmp(a)).1)
        .collect();
    let mut dims = x.dims().to_vec();
    *dims.last_mut().expect("a last dim") = 1;
    Ok(Tensor::from_vec(kth, dims, x.device())?)
}

/// [`kth_by_selection`] in device operations (no host round trip): the maximum taken `top`
/// times, each time with the values at or above the last one removed.
fn kth_by_maxima(x: &Tensor, top: usize) -> Result<Tensor> {
    let gone = Tensor::full(f32::NEG_INFINITY, x.shape(), x.device())?;
    let mut rest = x.clone();
    let mut kth = rest.max_keepdim(D::Minus1)?;
    for _ in 1..top {
        rest = rest.broadcast_ge(&kth)?.where_cond(&gone, &rest)?;
        kth = rest.max_keepdim(D::Minus1)?;
    }
    Ok(kth)
}

/// Plain causal softmax attention over explicit rows (`[positions, kv heads, head_dim]`), in f64.
fn reference(q: &[f32], start: usize, k: &[f32], v: &[f32], heads: Heads, scale: f32) -> Vec<f32> {
    let Heads { q: hq, kv, dim: d } = heads;
    let mut out = vec![0.0f64; q.len()];
    for (i, o) in out.chunks_mut(d).enumerate() {
        let (t, h) = (i / hq, i % hq);
        let g = h / (hq / kv);
        let s: Vec<f64> = (0..start + t + 1)
            .map(|p| (0..d).map(|e| (q[i * d + e] * k[(p * kv + g) * d + e]) as f64).sum::<f64>() * scale as f64)
            .collect();
        let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let z: f64 = w.iter().sum();
        for (p, w) in w.iter().enumerate() {
            (0..d).for_each(|e| o[e] += w / z * v[(p * kv + g) * d + e] as f64);
        }
    }
    out.into_iter().map(|x| x as f32).collect()
}

/// The rescoring attention on `device` against the f64 [`reference`] on fresh random rows from
/// `seed`, in two geometries (a small one and SmolLM2's heads): no position rescored equals
/// attention over the reconstructions, every coded position rescored equals exact attention (its
/// keys only: exact keys over the reconstructed values), and one rescored position per (query,
/// head) equals attention with that query's best coarse position made exact, which its chosen
/// mask ([`attend_choosing`]) names alone. Fails past 1e-4 (f32 sums of a few hundred terms of
/// order 1); returns the largest error.
pub fn check(device: &Device, seed: u64) -> Result<f32> {
    let mut rng = crate::synthetic::Rng(seed | 1);
    let mut worst = 0.0f32;
    for (heads, len, sink, coded, start) in
        [(Heads { q: 4, kv: 2, dim: 8 }, 40, 3, 30, 36), (Heads { q: 9, kv: 3, dim: 64 }, 300, 4, 260, 280)]
    {
        let (n, row, d) = (len - start, heads.kv * heads.dim, heads.dim);
        let mut uniform = |count: usize, scale: f32| -> Vec<f32> {
            (0..count).map(|_| (rng.uniform() as f32 * 2.0 - 1.0) * scale).collect()
        };
        let (exact_k, exact_v) = (uniform(len * row, 1.0), uniform(len * row, 1.0));
        let noise = uniform(2 * (coded - sink) * row, 0.5);
        let (nk, nv) = noise.split_at((coded - sink) * row);
        let span = sink * row..coded * row;
        let coarse_k: Vec<f32> = exact_k[span.clone()].iter().zip(nk).map(|(a, b)| a + b).collect();
        let coarse_v: Vec<f32> = exact_v[span.clone()].iter().zip(nv).map(|(a, b)| a + b).collect();
        let q = uniform(n * heads.q * d, 2.0);
        let scale = 1.0 / (d as f32).sqrt();
        let t = |x: &[f32], rows: usize| Tensor::from_vec(x.to_vec(), (rows, heads.kv, d), device);
        let (ek, ev, ck, cv) =
            (t(&exact_k, len)?, t(&exact_v, len)?, t(&coarse_k, coded - sink)?, t(&coarse_v, coded - sink)?);
        let rows = SeqRows { exact_k: &ek, exact_v: &ev, coarse_k: Some(&ck), coarse_v: Some(&cv), sink, coded };
        let qt = Tensor::from_vec(q.clone(), (n, heads.q, d), device)?;
        let got = |reread: Reread| -> Result<Vec<f32>> {
            Ok(attend(&qt, start, &rows, heads, scale, reread)?.flatten_all()?.to_vec1()?)
        };
        let mut close = |a: &[f32], b: &[f32], what: &str| -> Result<()> {
            let err = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
            worst = worst.max(err);
            match err < 1e-4 && a.len() == b.len() {
                true => Ok(()),
                false => Err(Error::Config(format!("rescoring attention, {what}: max error {err} on {device:?}"))),
            }
        };
        let mixed = |side: &[f32], coarse: &[f32]| {
            let mut m = side.to_vec();
            m[span.clone()].copy_from_slice(coarse);
            m
        };
        let (mk, mv) = (mixed(&exact_k, &coarse_k), mixed(&exact_v, &coarse_v));
        close(&got(Reread::rows(0))?, &reference(&q, start, &mk, &mv, heads, scale), "top 0")?;
        let every = Reread::rows(coded);
        close(&got(every)?, &reference(&q, start, &exact_k, &exact_v, heads, scale), "every coded position")?;
        let keys = Reread::keys(coded);
        close(&got(keys)?, &reference(&q, start, &exact_k, &mv, heads, scale), "every coded position's key")?;
        let (one, chosen) = attend_choosing(&qt, start, &rows, heads, scale, Reread::rows(1))?;
        let one: Vec<f32> = one.flatten_all()?.to_vec1()?;
        let chosen: Vec<Vec<Vec<u8>>> = chosen.ok_or_else(|| Error::Config("top 1 chose nothing".into()))?.to_vec3()?;
        let mut decided = 0;
        for i in 0..n * heads.q {
            let (t, h) = (i / heads.q, i % heads.q);
            let g = h / (heads.q / heads.kv);
            let qi = &q[i * d..(i + 1) * d];
            let score = |p: usize| -> f64 { (0..d).map(|e| (qi[e] * mk[(p * heads.kv + g) * d + e]) as f64).sum() };
            let mut ranked: Vec<(f64, usize)> = (sink..coded).map(|p| (score(p), p)).collect();
            ranked.sort_by(|a, b| b.0.total_cmp(&a.0));
            // Where the two best coarse scores are closer than the f32 scores' rounding could
            // order (a few ulps of sums of ~64 products of order 1; 1e-3 is far above), either
            // choice is right: such rows are not compared.
            if ranked[0].0 - ranked[1].0 < 1e-3 {
                continue;
            }
            decided += 1;
            let best = ranked[0].1;
            // The mask names it alone, in the row of (the group's head, the query).
            let marked = &chosen[g][(h % (heads.q / heads.kv)) * n + t];
            if marked.iter().map(|&m| m as usize).sum::<usize>() != 1 || marked[best - sink] != 1 {
                return Err(Error::Config(format!("rescoring check: query {t}, head {h} chose other than {best}")));
            }
            let (mut k1, mut v1) = (mk.clone(), mv.clone());
            let at = best * row..(best + 1) * row;
            k1[at.clone()].copy_from_slice(&exact_k[at.clone()]);
            v1[at.clone()].copy_from_slice(&exact_v[at]);
            // The reference for this one query row alone, at its own position.
            let want = reference(&q[t * heads.q * d..(t + 1) * heads.q * d], start + t, &k1, &v1, heads, scale);
            close(&one[i * d..(i + 1) * d], &want[h * d..(h + 1) * d], "top 1")?;
        }
        // Random scores leave a gap under 1e-3 between the two best rarely (a gap is ~0.3 wide
        // here): most rows are compared, whatever the seed.
        if decided * 2 < n * heads.q {
            return Err(Error::Config(format!("rescoring check: only {decided} of {} rows decided", n * heads.q)));
        }
    }
    Ok(worst)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic::Rng;

    #[test]
    fn rescoring_reads_exact_rows_at_the_top_coarse_positions_only() {
        let worst = check(&Device::Cpu, crate::testing::fresh_seed()).unwrap();
        assert!(worst > 0.0, "f32 against f64 differs somewhere");
    }

    /// The mask marks exactly the `top` largest of each row (against a sort; distinct values),
    /// and both ways to the `top`-th largest (the CPU's selection, other devices' repeated
    /// maxima) find the same value.
    #[test]
    fn top_mask_marks_the_largest() {
        let mut rng = Rng(crate::testing::fresh_seed() | 1);
        let (rows, cols) = (7usize, 53usize);
        let x: Vec<f32> = (0..rows * cols).map(|_| rng.uniform() as f32).collect();
        let t = Tensor::from_vec(x.clone(), (rows, cols), &Device::Cpu).unwrap();
        for top in [0, 1, 2, 16, 52, 53, 80] {
            let got: Vec<Vec<u8>> = top_mask(&t, top).unwrap().to_vec2().unwrap();
            for (r, m) in got.iter().enumerate() {
                let mut sorted = x[r * cols..(r + 1) * cols].to_vec();
                sorted.sort_by(|a, b| b.total_cmp(a));
                let want: Vec<u8> = match top {
                    0 => vec![0; cols],
                    _ => {
                        let kth = sorted[top.min(cols) - 1];
                        x[r * cols..(r + 1) * cols].iter().map(|&v| u8::from(v >= kth)).collect()
                    }
                };
                assert_eq!(m, &want, "row {r}, top {top}");
                assert_eq!(m.iter().map(|&b| b as usize).sum::<usize>(), top.min(cols));
            }
            if (1..cols).contains(&top) {
                let (a, b) = (kth_by_selection(&t, top).unwrap(), kth_by_maxima(&t, top).unwrap());
                assert_eq!(a.to_vec2::<f32>().unwrap(), b.to_vec2::<f32>().unwrap(), "top {top}");
            }
        }
    }
}
