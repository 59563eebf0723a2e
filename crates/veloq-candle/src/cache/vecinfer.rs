//! The VecInfer cache: keys and values as packed codebook indices, plus a small f16 window of the
//! most recent positions that is flushed to codes in blocks (so the quantizer runs once per block,
//! not once per token).
//!
//! Decode attention never rebuilds keys: the query is moved into code space (q̃ = H(s ⊙ q)), a
//! lookup table LUT[j][c] = q̃_j · C_j[c] is built once per query head, and each cached position
//! scores as Σ_j LUT[j][code_j]. Values are accumulated per centroid (W[j][c] += p_t) and decoded
//! once per head at the end, then rotated back. The f16 rows (sink and window) are attended exactly
//! and merged in the same softmax. Several queries at once (prefill, teacher-forced evaluation)
//! attend over decoded rows through candle's matmul.

use std::sync::Arc;

use candle_core::Tensor;
use half::f16;
use rayon::prelude::*;

use veloq::codec::pack;
use veloq::codec::vecinfer::VecInferCodec;

use super::dense::{axpy, dot, output, query_rows, softmax, widen};
use super::store::{CodedStore, WindowConfig};
use super::{token_major, LayerCache};
use crate::error::Result;

pub struct VecInferCache {
    store: CodedStore,
    keys: Arc<VecInferCodec>,
    values: Arc<VecInferCodec>,
    /// Codebooks transposed to `[books][sub_dim][centroids]`, so building the lookup table and
    /// decoding the per-centroid value sums run along contiguous centroid rows (SIMD-friendly).
    keys_t: Vec<f32>,
    values_t: Vec<f32>,
}

impl VecInferCache {
    pub fn new(keys: Arc<VecInferCodec>, values: Arc<VecInferCodec>, cfg: WindowConfig) -> Result<Self> {
        let store = CodedStore::new(keys.clone(), values.clone(), cfg)?;
        Ok(Self { store, keys_t: transposed(&keys), values_t: transposed(&values), keys, values })
    }

    /// Code `j` of kv-head `h` at coded position `t`.
    #[inline]
    fn code(&self, blocks: &[Box<[u8]>], bits: u32, m: usize, t: usize, h: usize, j: usize) -> usize {
        let b = self.store.cfg.flush_block;
        let idx = ((t % b) * self.store.n_kv + h) * m + j;
        pack::get(&blocks[t / b], bits, idx) as usize
    }

    /// Single-query attention for every query head over codes + window.
    fn attend_decode(&self, q: &Tensor, scale: f64) -> Result<Tensor> {
        let (_, hq, _, d) = q.dims4()?;
        let qr = query_rows(q)?;
        let st = &self.store;
        let n_kv = st.n_kv;
        let g = hq / n_kv;
        let (kc, vc) = (&*self.keys, &*self.values);
        let (m, sd) = (kc.subspaces(), kc.shape().sub_dim);
        let (kk, vk) = (kc.shape().centroids(), vc.shape().centroids());
        let (mv, sdv) = (vc.subspaces(), vc.shape().sub_dim);
        let (kbits, vbits) = (kc.shape().bits, vc.shape().bits);
        // Exact rows (sink, then window) share the softmax with the coded ones; order is free.
        let wn = st.sink_len() + st.window_len();
        let wk = widened(&[&st.sink_k[..], &st.window_k[..]].concat());
        let wv = widened(&[&st.sink_v[..], &st.window_v[..]].concat());
        let (coded, row, bsz) = (st.coded, st.row(), st.cfg.flush_block);
        let mut out = vec![0.0f32; hq * d];
        out.par_chunks_mut(d).enumerate().for_each(|(qh, o)| {
            let h = qh / g;
            let qv: Vec<f32> = qr[qh * d..(qh + 1) * d].iter().map(|x| x * scale as f32).collect();
            let mut p = vec![0.0f32; coded + wn];
            if coded > 0 {
                let mut qt = vec![0.0f32; d];
                kc.transform_query(h, &qv, &mut qt);
                let mut lut = vec![0.0f32; m * kk];
                for (j, row) in lut.chunks_exact_mut(kk).enumerate() {
                    let bt = book_t(&self.keys_t, kc, j);
                    for d in 0..sd {
                        let qd = qt[j * sd + d];
                        row.iter_mut().zip(&bt[d * kk..(d + 1) * kk]).for_each(|(l, c)| *l += c * qd);
                    }
                }
                // Centering: q·k = q·μ + q̃·x̂; the offset is the same for every coded position.
                let offset = kc.transform().query_offset(h, &qv);
                lut[..kk].iter_mut().for_each(|l| *l += offset);
                if kbits == 8 {
                    // Fast path: one byte per code, a block's codes for head h are contiguous rows.
                    for (t, pv) in p[..coded].iter_mut().enumerate() {
                        let codes = &st.key_blocks[t / bsz][((t % bsz) * n_kv + h) * m..][..m];
                        let mut s = 0.0;
                        for (j, &c) in codes.iter().enumerate() {
                            s += lut[j * kk + c as usize];
                        }
                        *pv = s;
                    }
                } else {
                    for (t, pv) in p[..coded].iter_mut().enumerate() {
                        *pv = (0..m).map(|j| lut[j * kk + self.code(&st.key_blocks, kbits, m, t, h, j)]).sum();
                    }
                }
            }
            for (i, pv) in p[coded..].iter_mut().enumerate() {
                *pv = dot(&qv, &wk[i * row + h * d..][..d]);
            }
            softmax(&mut p);
            if coded > 0 {
                let mut acc = vec![0.0f32; mv * vk];
                if vbits == 8 {
                    for (t, &pv) in p[..coded].iter().enumerate() {
                        let codes = &st.value_blocks[t / bsz][((t % bsz) * n_kv + h) * mv..][..mv];
                        for (j, &c) in codes.iter().enumerate() {
                            acc[j * vk + c as usize] += pv;
                        }
                    }
                } else {
                    for (t, &pv) in p[..coded].iter().enumerate() {
                        for j in 0..mv {
                            acc[j * vk + self.code(&st.value_blocks, vbits, mv, t, h, j)] += pv;
                        }
                    }
                }
                let mut rot = vec![0.0f32; d];
                for j in 0..mv {
                    let bt = book_t(&self.values_t, vc, j);
                    for dd in 0..sdv {
                        rot[j * sdv + dd] = dot(&acc[j * vk..(j + 1) * vk], &bt[dd * vk..(dd + 1) * vk]);
                    }
                }
                let coded_mass: f32 = p[..coded].iter().sum();
                vc.transform().inverse_weighted(h, &mut rot, coded_mass);
                o.copy_from_slice(&rot);
            }
            for (i, &pv) in p[coded..].iter().enumerate() {
                axpy(pv, &wv[i * row + h * d..][..d], o);
            }
        });
        output(out, hq, d, q.device())
    }
}

fn widened(window: &[f16]) -> Vec<f32> {
    let mut out = vec![0.0f32; window.len()];
    widen(window, &mut out);
    out
}

/// All codebooks of `codec`, each transposed to `[sub_dim][centroids]`, concatenated.
fn transposed(codec: &VecInferCodec) -> Vec<f32> {
    let (k, sd) = (codec.shape().centroids(), codec.shape().sub_dim);
    let mut out = Vec::with_capacity(codec.books().books().len() * k * sd);
    for b in codec.books().books() {
        for d in 0..sd {
            out.extend((0..k).map(|c| b.centroid(c)[d]));
        }
    }
    out
}

/// The transposed codebook that sub-space `j` uses.
#[inline]
fn book_t<'a>(all: &'a [f32], codec: &VecInferCodec, j: usize) -> &'a [f32] {
    let size = codec.shape().centroids() * codec.shape().sub_dim;
    let b = codec.books().book_index(j);
    &all[b * size..(b + 1) * size]
}

impl LayerCache for VecInferCache {
    fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        let (h, _, d, kr) = token_major(k)?;
        let (_, _, _, vr) = token_major(v)?;
        self.store.push(h, d, &kr, &vr)
    }

    /// Several queries (prefill, teacher-forced evaluation) attend over decoded rows with candle's
    /// matmul; one query (decode) takes the lookup-table path.
    fn attend(&mut self, q: &Tensor, scale: f64) -> Result<Tensor> {
        let y = if q.dim(2)? > 1 {
            self.store.attend_decoded(q, scale)?
        } else {
            self.attend_decode(q, scale)?
        };
        self.store.flush()?;
        Ok(y)
    }

    fn len(&self) -> usize {
        self.store.len()
    }
    fn resident_bytes(&self) -> usize {
        self.store.resident_bytes()
    }
    fn truncate(&mut self, len: usize) -> Result<()> {
        self.store.truncate(len)
    }
    fn commit(&mut self) -> Result<()> {
        self.store.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use veloq::calibrate::{train_codec, KMeansConfig};
    use veloq::codec::codebook::PqShape;
    use veloq::codec::vecinfer::CodecSpec;
    use crate::cache::dense::attend_dense;
    use crate::testing::{fresh_seed, randn};


    /// The lookup-table decode path equals dense attention over the decoded codes + window, for
    /// 8-bit and packed 6-bit codes, GQA, and lengths that leave a partial window.
    #[test]
    fn lut_decode_matches_dense_attention_over_decoded_keys() {
        let seed = fresh_seed();
        let dev = Device::Cpu;
        let (hkv, hq, d) = (2, 6, 64);
        for (bits, sd, len) in [(8u32, 4usize, 77usize), (6, 2, 41), (8, 8, 130)] {
            let shape = PqShape::new(sd, bits).unwrap();
            let train = randn(400 * hkv * d, seed, false);
            let (kc, _) = train_codec(&train, hkv, d, &CodecSpec::keys(shape), &KMeansConfig::new(1 << bits, 1)).unwrap();
            let (vc, _) = train_codec(&train, hkv, d, &CodecSpec::values(shape), &KMeansConfig::new(1 << bits, 2)).unwrap();
            let mut cache = VecInferCache::new(Arc::new(kc), Arc::new(vc), WindowConfig { window: 8, flush_block: 8, sink: 3 }).unwrap();
            let k = Tensor::from_vec(randn(hkv * len * d, seed + 1, false), (1, hkv, len, d), &dev).unwrap();
            let v = Tensor::from_vec(randn(hkv * len * d, seed + 2, false), (1, hkv, len, d), &dev).unwrap();
            cache.append(&k, &v).unwrap();
            cache.store.flush().unwrap();
            assert!(cache.store.coded > 0 && cache.store.window_len() > 0 && cache.store.sink_len() == 3);
            let q = Tensor::from_vec(randn(hq * d, seed + 3, false), (1, hq, 1, d), &dev).unwrap();
            let got = cache.attend_decode(&q, 0.125).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let kd = cache.store.decode_all(true).unwrap();
            let vd = cache.store.decode_all(false).unwrap();
            let want = attend_dense(&q, kd, vd, hkv, 0.125).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let err: f32 = got.iter().zip(&want).map(|(a, b)| (a - b).powi(2)).sum::<f32>().sqrt();
            let norm: f32 = want.iter().map(|a| a * a).sum::<f32>().sqrt();
            assert!(err <= 1e-4 * norm, "seed {seed} bits {bits}: rel err {}", err / norm);
        }
    }
}
