//! Attention partials in candle tensor ops, tiled so that scratch never grows with the context:
//! f16 rows a chunk at a time (matmul scores, masks only where a chunk crosses a query's
//! position or window), VecInfer codes a chunk at a time through per-query lookup tables (`gather`
//! for scores, `scatter_add` per centroid for values, decoded once at the end). Both keep an
//! online softmax per query head: `m` (running maximum), `l` (sum of weights), `o` (weighted sum).

use candle_core::{DType, Device, Tensor, D};

use super::codec::TensorCodec;
use crate::error::Result;

/// Rows of f16 keys one chunk scores.
pub const ROW_CHUNK: usize = 1024;
/// Bytes one gather/scatter chunk may expand code indices to.
const CODE_CHUNK_BYTES: usize = 32 << 20;
/// A maximum below every real score, so that `exp(m_old − m_new)` is never `exp(−∞ + ∞)`.
const FLOOR: f64 = -1e30;

/// Online softmax state of `r` rows (query heads × queries) for `d`-vectors: `o [.., r, d]`,
/// `m` and `l` `[.., r, 1]`.
#[derive(Clone, Debug)]
pub struct State {
    /// Weighted value sums.
    pub o: Tensor,
    /// Running maxima.
    pub m: Tensor,
    /// Sums of weights.
    pub l: Tensor,
}

impl State {
    /// Nothing attended, shaped `lead × r` rows.
    pub fn empty(lead: usize, r: usize, d: usize, dev: &Device) -> Result<Self> {
        Ok(Self {
            o: Tensor::zeros((lead, r, d), DType::F32, dev)?,
            m: Tensor::full(FLOOR as f32, (lead, r, 1), dev)?,
            l: Tensor::zeros((lead, r, 1), DType::F32, dev)?,
        })
    }

    /// Moves the maximum and the sum over scores `s` (`[lead, r, n]`, −∞ where masked): returns
    /// their weights `p` and the factor `alpha` (`[lead, r, 1]`) by which what was accumulated
    /// before must be rescaled. The caller accumulates the weighted values.
    pub fn step(&mut self, s: &Tensor) -> Result<(Tensor, Tensor)> {
        let m = self.m.maximum(&s.max_keepdim(D::Minus1)?)?;
        let alpha = (&self.m - &m)?.exp()?;
        let p = s.broadcast_sub(&m)?.exp()?;
        self.l = ((&self.l * &alpha)? + p.sum_keepdim(D::Minus1)?)?;
        self.m = m;
        Ok((p, alpha))
    }

    /// Folds scores `s` (`[lead, r, n]`, −∞ where masked) and their values `v` (`[lead, n, d]`).
    pub fn fold(&mut self, s: &Tensor, v: &Tensor) -> Result<()> {
        let (p, alpha) = self.step(s)?;
        self.o = (self.o.broadcast_mul(&alpha)? + p.matmul(v)?)?;
        Ok(())
    }

    /// The state of what `self` and `other` attended together.
    pub fn merge(&self, other: &State) -> Result<State> {
        let m = self.m.maximum(&other.m)?;
        let (a, b) = ((&self.m - &m)?.exp()?, (&other.m - &m)?.exp()?);
        Ok(State {
            o: (self.o.broadcast_mul(&a)? + other.o.broadcast_mul(&b)?)?,
            l: ((&self.l * &a)? + (&other.l * &b)?)?,
            m,
        })
    }

    /// `o / l` (0 where nothing was attended).
    pub fn finish(&self) -> Result<Tensor> {
        Ok(self.o.broadcast_div(&self.l.maximum(1e-30)?)?)
    }
}

/// A chunk of f16 rows (`[kv, n, D]` each) holding consecutive positions from `pos0`.
pub struct RowChunk {
    /// Keys `[kv, n, D]`.
    pub keys: Tensor,
    /// Values `[kv, n, D]`.
    pub values: Tensor,
    /// Position of the first row.
    pub pos0: usize,
}

/// Folds row chunks into the state of queries `qh` (`[kv, G·t, D]` f32, scaled; row `g·t + i` is
/// query `i` of group head `g`) at positions `q_pos` (length `t`).
pub fn fold_rows(
    state: &mut State,
    qh: &Tensor,
    q_pos: &[usize],
    chunks: &[RowChunk],
    window: Option<usize>,
) -> Result<()> {
    let (kv, gt, _) = qh.dims3()?;
    let t = q_pos.len();
    let g = gt / t;
    let (first_q, last_q) = (q_pos[0], q_pos[t - 1]);
    for c in chunks {
        let n = c.keys.dim(1)?;
        let (lo, hi) = (c.pos0, c.pos0 + n - 1);
        // Nothing visible: all rows after the last query, or all before every window.
        if lo > last_q || window.is_some_and(|w| hi + w <= first_q) {
            continue;
        }
        let k = c.keys.to_dtype(DType::F32)?;
        let mut s = qh.matmul(&k.t()?)?; // [kv, G·t, n]
        let partial = hi > first_q || window.is_some_and(|w| lo + w <= last_q);
        if partial {
            let mask: Vec<f32> = q_pos
                .iter()
                .flat_map(|&qp| {
                    (lo..=hi).map(
                        move |p| if p <= qp && window.is_none_or(|w| qp - p < w) { 0.0 } else { f32::NEG_INFINITY },
                    )
                })
                .collect();
            let mask = Tensor::from_vec(mask, (1, 1, t, n), qh.device())?;
            s = s.reshape((kv, g, t, n))?.broadcast_add(&mask)?.reshape((kv, gt, n))?;
        }
        state.fold(&s, &c.values.to_dtype(DType::F32)?)?;
    }
    Ok(())
}

/// Indices of code chunk `c` (`[kv, n, M]`) for a gather over `[Hq, t, M, K]` tables:
/// `[Hq, t, M, n]` u32 (query heads grouped `g` per kv head).
fn gather_index(c: &Tensor, g: usize, t: usize) -> Result<Tensor> {
    let (kv, n, m) = c.dims3()?;
    let c = c.to_dtype(DType::U32)?.permute((0, 2, 1))?; // [kv, M, n]
    let c = c.unsqueeze(1)?.broadcast_as((kv, g, m, n))?.reshape((kv * g, m, n))?; // [Hq, M, n]
    Ok(c.unsqueeze(1)?.broadcast_as((kv * g, t, m, n))?.contiguous()?)
}

/// Queries from which [`codes_state`] scores decoded chunks instead of lookup tables.
const DECODED_FROM_QUERIES: usize = 8;

/// Partial of queries `qs` (`[Hq, t, D]` f32, scaled) over `len` coded positions of one sequence
/// (`codes`: key and value codes `[kv, ≥len, M]`), in value space. `[Hq, t, ·]` state.
///
/// A few queries (decode) go through per-query lookup tables: M·K entries per query head, then a
/// gather per position and sub-space. Past [`DECODED_FROM_QUERIES`] (prefill) the tables are the
/// larger work, 16× more with 4096-centroid books, and each chunk of codes is decoded instead into
/// code-space centroid rows `[kv, n, D]` (scratch of one chunk; nothing is stored) and scored and
/// summed by matmuls. The same arithmetic up to summation order.
pub fn codes_state(
    qs: &Tensor,
    keys: (&TensorCodec, &Tensor),
    values: (&TensorCodec, &Tensor),
    len: usize,
) -> Result<State> {
    if qs.dim(1)? >= DECODED_FROM_QUERIES {
        decoded_codes_state(qs, keys, values, len)
    } else {
        table_codes_state(qs, keys, values, len)
    }
}

/// [`codes_state`] by lookup tables: scores gathered per sub-space, weights summed per centroid
/// (`scatter_add`), decoded once at the end.
fn table_codes_state(
    qs: &Tensor,
    keys: (&TensorCodec, &Tensor),
    values: (&TensorCodec, &Tensor),
    len: usize,
) -> Result<State> {
    let (hq, t, d) = qs.dims3()?;
    let (kc, vc) = (keys.0, values.0);
    let g = hq / kc.heads;
    let dev = qs.device();
    let mut state = State::empty(hq, t, d, dev)?;
    let (qt, offset) = code_space_queries(qs, kc)?;
    let (m, kk) = (kc.subspaces(), kc.centroids);
    let lut = kc.lookup_tables(&qt.reshape((hq * t, d))?)?.reshape((hq, t, m, kk))?;
    let (mv, kv_c) = (vc.subspaces(), vc.centroids);
    let mut w = Tensor::zeros((hq, t, mv, kv_c), DType::F32, dev)?;
    let chunk = (CODE_CHUNK_BYTES / (hq * t * m.max(mv) * 4)).max(16);
    for s0 in (0..len).step_by(chunk) {
        let n = chunk.min(len - s0);
        let mut s = lut.gather(&gather_index(&keys.1.narrow(1, s0, n)?, g, t)?, 3)?.sum(2)?; // [Hq, t, n]
        if let Some(off) = &offset {
            s = s.broadcast_add(off)?;
        }
        let (p, alpha) = state.step(&s)?;
        let idx = gather_index(&values.1.narrow(1, s0, n)?, g, t)?;
        let src = p.unsqueeze(2)?.broadcast_as((hq, t, mv, n))?.contiguous()?;
        w = w.broadcast_mul(&alpha.unsqueeze(3)?)?.scatter_add(&idx, &src, 3)?;
    }
    // Per-centroid weights back to vectors: decode, then out of code space.
    let o = vc.decode_sums(&w.reshape((hq * t, mv, kv_c))?)?.reshape((hq, t, d))?;
    state.o = value_space(&o, &state.l, vc)?;
    Ok(state)
}

/// [`codes_state`] by decoded chunks: scores q̃·ĉ (+ the centering offset) and code-space value
/// sums, rotated back once at the end.
fn decoded_codes_state(
    qs: &Tensor,
    keys: (&TensorCodec, &Tensor),
    values: (&TensorCodec, &Tensor),
    len: usize,
) -> Result<State> {
    let (hq, t, d) = qs.dims3()?;
    let (kc, vc) = (keys.0, values.0);
    let kv = kc.heads;
    let gt = hq / kv * t;
    let (qt, offset) = code_space_queries(qs, kc)?;
    // Row g·t + i of kv head h: query i of head h·G + g.
    let qh = qt.reshape((kv, gt, d))?;
    let offset = offset.map(|o| o.reshape((kv, gt, 1))).transpose()?;
    let mut state = State::empty(kv, gt, d, qs.device())?;
    for s0 in (0..len).step_by(ROW_CHUNK) {
        let n = ROW_CHUNK.min(len - s0);
        let rows = |c: &TensorCodec, codes: &Tensor| -> Result<Tensor> {
            Ok(c.centroid_rows(&codes.narrow(1, s0, n)?)?.reshape((kv, n, d))?)
        };
        let mut s = qh.matmul(&rows(kc, keys.1)?.t()?)?; // [kv, G·t, n]
        if let Some(off) = &offset {
            s = s.broadcast_add(off)?;
        }
        state.fold(&s, &rows(vc, values.1)?)?;
    }
    let back = |x: &Tensor| -> Result<Tensor> { Ok(x.reshape((hq, t, ()))?) };
    let (o, l) = (back(&state.o)?, back(&state.l)?);
    Ok(State { o: value_space(&o, &l, vc)?, m: back(&state.m)?, l })
}

/// Queries `qs` (`[Hq, t, D]`, scaled) in the keys' code space, q̃ = H(s ⊙ q), and the offset
/// q·μ that centering adds to every score (`[Hq, t, 1]`), if the keys are centered.
fn code_space_queries(qs: &Tensor, kc: &TensorCodec) -> Result<(Tensor, Option<Tensor>)> {
    let (hq, t, d) = qs.dims3()?;
    let g = hq / kc.heads;
    let mut qt = qs.clone();
    if let Some(sc) = &kc.scale {
        qt = qt.broadcast_mul(&per_q_head(sc, g)?.unsqueeze(1)?)?;
    }
    let qt = kc.rotate(&qt.reshape((hq * t, d))?)?.reshape((hq, t, d))?;
    let offset = match &kc.mean {
        Some(mu) => Some(qs.broadcast_mul(&per_q_head(mu, g)?.unsqueeze(1)?)?.sum_keepdim(D::Minus1)?),
        None => None,
    };
    Ok((qt, offset))
}

/// A weighted sum of value centroids `o` (`[Hq, t, D]`, code space, total weight `l`
/// `[Hq, t, 1]`) in value space: rotated back, scaled, plus μ times the weight.
fn value_space(o: &Tensor, l: &Tensor, vc: &TensorCodec) -> Result<Tensor> {
    let (hq, t, d) = o.dims3()?;
    let g = hq / vc.heads;
    let mut o = vc.rotate(&o.reshape((hq * t, d))?)?.reshape((hq, t, d))?;
    if let Some(sc) = &vc.scale {
        o = o.broadcast_mul(&per_q_head(sc, g)?.unsqueeze(1)?)?;
    }
    if let Some(mu) = &vc.mean {
        o = o.broadcast_add(&l.broadcast_mul(&per_q_head(mu, g)?.unsqueeze(1)?)?)?;
    }
    Ok(o)
}

/// `[kv, ...]` rows repeated for the `g` query heads of each kv head: `[kv·g, ...]`.
pub fn per_q_head(t: &Tensor, g: usize) -> Result<Tensor> {
    let kv = t.dim(0)?;
    let rest: Vec<usize> = t.dims()[1..].to_vec();
    let mut shape = vec![kv, g];
    shape.extend(&rest);
    let mut out = vec![kv * g];
    out.extend(&rest);
    Ok(t.unsqueeze(1)?.broadcast_as(shape)?.contiguous()?.reshape(out)?)
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};
    use veloq::codec::codebook::{Codebook, CodebookSet, Granularity, PqShape};
    use veloq::codec::smooth::SmoothScales;
    use veloq::codec::vecinfer::VecInferCodec;

    use super::*;

    fn normal(n: usize) -> Vec<f32> {
        Tensor::randn(0f32, 1.0, n, &Device::Cpu).unwrap().to_vec1().unwrap()
    }

    /// A codec with random books, mean and smoothing scales.
    fn codec(bits: u32, sub_dim: usize, granularity: Granularity, kv: usize, d: usize) -> TensorCodec {
        let shape = PqShape::new(sub_dim, bits).unwrap();
        let m = d / sub_dim;
        let count = if granularity == Granularity::PerLayer { 1 } else { m };
        let books = (0..count).map(|_| Codebook::new(sub_dim, normal(shape.centroids() * sub_dim)).unwrap()).collect();
        let books = CodebookSet::new(shape, granularity, m, books).unwrap();
        let scales = normal(kv * d).iter().map(|x| 0.5 + x.abs()).collect();
        let smooth = SmoothScales::new(kv, d, scales).unwrap();
        let codec = VecInferCodec::new(kv, d, Some(normal(kv * d)), Some(smooth), true, books).unwrap();
        TensorCodec::new(&codec, &Device::Cpu).unwrap()
    }

    fn codes(c: &TensorCodec, kv: usize, len: usize) -> Tensor {
        let k = c.centroids as f32;
        let u = Tensor::rand(0f32, k, (kv, len, c.subspaces()), &Device::Cpu).unwrap();
        u.floor().unwrap().minimum(k - 1.0).unwrap().to_dtype(DType::U32).unwrap()
    }

    fn max_rel(a: &Tensor, b: &Tensor) -> f32 {
        let (a, b) =
            (a.flatten_all().unwrap().to_vec1::<f32>().unwrap(), b.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
        a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max) / scale
    }

    /// Decoded chunks and lookup tables are two evaluations of one sum: the same outputs and
    /// maxima for many queries over codes crossing chunk boundaries, with 256- and 4096-centroid
    /// books, per layer and per sub-space, the keys centered, smoothed and rotated.
    #[test]
    fn decoded_chunks_match_lookup_tables() {
        let (kv, g, d, t) = (2, 3, 32, DECODED_FROM_QUERIES + 1);
        for (bits, sub_dim, granularity, len) in [
            (8, 4, Granularity::PerLayer, ROW_CHUNK + 77),
            (12, 4, Granularity::PerSubspace, 700),
            (8, 8, Granularity::PerSubspace, 2 * ROW_CHUNK + 5),
        ] {
            let (kc, vc) = (codec(bits, sub_dim, granularity, kv, d), codec(bits, sub_dim, granularity, kv, d));
            let (kcodes, vcodes) = (codes(&kc, kv, len + 9), codes(&vc, kv, len + 9));
            let qs = Tensor::randn(0f32, 0.3, (kv * g, t, d), &Device::Cpu).unwrap();
            let a = decoded_codes_state(&qs, (&kc, &kcodes), (&vc, &vcodes), len).unwrap();
            let b = table_codes_state(&qs, (&kc, &kcodes), (&vc, &vcodes), len).unwrap();
            let (out, m) = (max_rel(&a.finish().unwrap(), &b.finish().unwrap()), max_rel(&a.m, &b.m));
            assert!(
                out < 1e-4 && m < 1e-4,
                "{bits}-bit books of {sub_dim}, {granularity:?}: outputs {out}, maxima {m}"
            );
            // Not a degenerate case: the outputs vary across queries.
            assert!(b.finish().unwrap().flatten_all().unwrap().var(0).unwrap().to_scalar::<f32>().unwrap() > 1e-6);
        }
    }
}
