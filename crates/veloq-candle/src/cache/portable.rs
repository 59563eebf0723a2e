//! The VecInfer cache in candle tensor ops only (see [`crate::portable`]): codes live in device
//! tensors (u8 for ≤ 256 centroids), attention is the same lookup-table form as the fused CPU
//! path (gather from per-query tables for scores, scatter-add per centroid for values) and never
//! rebuilds keys. It runs on any candle device; it is what `KernelChoice::Forbid` selects, and what
//! `Auto` falls back to where no fused kernel exists. Every gather/scatter works on chunks of the
//! sequence, so its scratch stays bounded.

use candle_core::{DType, Device, Tensor, D};

use veloq::codec::vecinfer::VecInferCodec;

use super::store::WindowConfig;
use super::LayerCache;
use crate::error::{Error, Result};
use crate::portable::PortableCodec;

/// Bytes one gather/scatter chunk may expand its code indices to.
const CHUNK_BYTES: usize = 64 << 20;

pub struct PortableVecInferCache {
    keys: PortableCodec,
    values: PortableCodec,
    cfg: WindowConfig,
    n_kv: usize,
    head_dim: usize,
    dev: Device,
    /// Token-major f16 `[n, H, D]` rows: the sink, then the window.
    sink: Option<(Tensor, Tensor)>,
    window: Option<(Tensor, Tensor)>,
    /// Code blocks `[flush_block, H, M]`.
    key_codes: Vec<Tensor>,
    value_codes: Vec<Tensor>,
    coded: usize,
}

fn rows(t: &Option<(Tensor, Tensor)>) -> usize {
    t.as_ref().map_or(0, |(k, _)| k.dim(0).unwrap_or(0))
}

fn cat_opt(a: &Option<(Tensor, Tensor)>, k: Tensor, v: Tensor) -> Result<(Tensor, Tensor)> {
    Ok(match a {
        Some((ak, av)) => (Tensor::cat(&[ak, &k], 0)?, Tensor::cat(&[av, &v], 0)?),
        None => (k, v),
    })
}

impl PortableVecInferCache {
    pub fn new(keys: &VecInferCodec, values: &VecInferCodec, cfg: WindowConfig, dev: &Device) -> Result<Self> {
        if cfg.flush_block == 0 {
            return Err(Error::Config("flush_block must be positive".into()));
        }
        Ok(Self {
            keys: PortableCodec::new(keys, dev)?,
            values: PortableCodec::new(values, dev)?,
            cfg,
            n_kv: keys.n_heads(),
            head_dim: keys.head_dim(),
            dev: dev.clone(),
            sink: None,
            window: None,
            key_codes: Vec::new(),
            value_codes: Vec::new(),
            coded: 0,
        })
    }

    fn flush(&mut self) -> Result<()> {
        let b = self.cfg.flush_block;
        while rows(&self.window) >= self.cfg.window + b {
            let (wk, wv) = self.window.take().expect("window");
            let n = wk.dim(0)?;
            self.key_codes.push(self.keys.quantize(&wk.narrow(0, 0, b)?)?);
            self.value_codes.push(self.values.quantize(&wv.narrow(0, 0, b)?)?);
            self.coded += b;
            self.window = Some((wk.narrow(0, b, n - b)?.contiguous()?, wv.narrow(0, b, n - b)?.contiguous()?));
        }
        Ok(())
    }

    /// `[Hq, ...]` rows of a per-kv-head `[H, D]` table, for query heads grouped `g` per kv head.
    fn per_q_head(&self, t: &Tensor, hq: usize) -> Result<Tensor> {
        let g = hq / self.n_kv;
        let idx = Tensor::from_vec((0..hq as u32).map(|i| i / g as u32).collect::<Vec<_>>(), hq, &self.dev)?;
        Ok(t.index_select(&idx, 0)?)
    }

    /// Code indices `[S, H, M]` for positions `s0..s0+len` as `[Hq, T, M, len]` u32 (gather layout).
    fn index_chunk(&self, codes: &Tensor, s0: usize, len: usize, hq: usize, t: usize) -> Result<Tensor> {
        let m = codes.dim(2)?;
        let c = codes.narrow(0, s0, len)?.to_dtype(DType::U32)?.permute((1, 2, 0))?; // [H, M, len]
        let c = self.per_q_head(&c.contiguous()?, hq)?; // [Hq, M, len]
        Ok(c.unsqueeze(1)?.broadcast_as((hq, t, m, len))?.contiguous()?)
    }

    fn attend_all(&self, q: &Tensor, scale: f64) -> Result<Tensor> {
        let (_, hq, t, d) = q.dims4()?;
        let g = hq / self.n_kv;
        let qs = (q.squeeze(0)?.to_dtype(DType::F32)? * scale)?; // [Hq, T, D]
        let len = rows(&self.sink) + self.coded + rows(&self.window);
        // Exact rows: sink then window, with their positions for the causal mask.
        let mut exact: Vec<(Tensor, Tensor)> = Vec::new();
        let mut pos: Vec<u32> = Vec::new();
        if let Some(s) = &self.sink {
            exact.push(s.clone());
            pos.extend(0..rows(&self.sink) as u32);
        }
        if let Some(w) = &self.window {
            exact.push(w.clone());
            let w0 = rows(&self.sink) + self.coded;
            pos.extend(w0 as u32..len as u32);
        }
        let e = pos.len();
        let mut scores = Vec::new();
        let codes_k = if self.coded > 0 { Some(Tensor::cat(&self.key_codes, 0)?) } else { None };
        let s = self.coded;
        let m = self.keys.subspaces();
        let chunk = (CHUNK_BYTES / (hq * t * m * 4)).max(1);
        if let Some(ck) = &codes_k {
            // Query in code space: q̃ = H(s ⊙ q), plus q·μ for the centering.
            let mut qt = qs.clone();
            if let Some(sc) = &self.keys.scale {
                qt = qt.broadcast_mul(&self.per_q_head(sc, hq)?.unsqueeze(1)?)?;
            }
            let qt = self.keys.rotate(&qt.reshape((hq * t, d))?)?;
            let lut = self.keys.lookup_tables(&qt)?.reshape((hq, t, m, self.keys.centroids))?;
            let mut sc_parts = Vec::new();
            for s0 in (0..s).step_by(chunk) {
                let n = chunk.min(s - s0);
                let idx = self.index_chunk(ck, s0, n, hq, t)?;
                sc_parts.push(lut.gather(&idx, 3)?.sum(2)?); // [Hq, T, n]
            }
            let mut sc = Tensor::cat(&sc_parts, 2)?;
            if let Some(mu) = &self.keys.mean {
                let off = qs.broadcast_mul(&self.per_q_head(mu, hq)?.unsqueeze(1)?)?.sum_keepdim(D::Minus1)?; // [Hq, T, 1]
                sc = sc.broadcast_add(&off)?;
            }
            scores.push(sc);
        }
        let exact_kv = if e > 0 {
            let ek: Vec<&Tensor> = exact.iter().map(|(k, _)| k).collect();
            let ev: Vec<&Tensor> = exact.iter().map(|(_, v)| v).collect();
            let k = Tensor::cat(&ek, 0)?.to_dtype(DType::F32)?.transpose(0, 1)?.contiguous()?; // [H, E, D]
            let v = Tensor::cat(&ev, 0)?.to_dtype(DType::F32)?.transpose(0, 1)?.contiguous()?;
            let se = qs.reshape((self.n_kv, g * t, d))?.matmul(&k.t()?)?.reshape((hq, t, e))?;
            // Causal: query i (position len − T + i) sees exact rows at positions ≤ its own.
            let qpos: Vec<u32> = (0..t as u32).map(|i| (len - t) as u32 + i).collect();
            let mask: Vec<f32> = qpos.iter().flat_map(|&qp| pos.iter().map(move |&p| if p > qp { f32::NEG_INFINITY } else { 0.0 })).collect();
            let mask = Tensor::from_vec(mask, (1, t, e), &self.dev)?;
            scores.push(se.broadcast_add(&mask)?);
            Some(v)
        } else {
            None
        };
        let all = Tensor::cat(&scores, 2)?;
        let p = candle_nn::ops::softmax_last_dim(&all)?;
        let mut out = Tensor::zeros((hq, t, d), DType::F32, &self.dev)?;
        if s > 0 {
            let codes_v = Tensor::cat(&self.value_codes, 0)?;
            let (mv, kv) = (self.values.subspaces(), self.values.centroids);
            let pc = p.narrow(2, 0, s)?;
            let mut w = Tensor::zeros((hq, t, mv, kv), DType::F32, &self.dev)?;
            let chunk_v = (CHUNK_BYTES / (hq * t * mv * 4)).max(1);
            for s0 in (0..s).step_by(chunk_v) {
                let n = chunk_v.min(s - s0);
                let idx = self.index_chunk(&codes_v, s0, n, hq, t)?;
                let src = pc.narrow(2, s0, n)?.unsqueeze(2)?.broadcast_as((hq, t, mv, n))?.contiguous()?;
                w = w.scatter_add(&idx, &src, 3)?;
            }
            let oc = self.values.decode_sums(&w.reshape((hq * t, mv, kv))?)?;
            let mut oc = self.values.rotate(&oc)?.reshape((hq, t, d))?;
            if let Some(sc) = &self.values.scale {
                oc = oc.broadcast_mul(&self.per_q_head(sc, hq)?.unsqueeze(1)?)?;
            }
            if let Some(mu) = &self.values.mean {
                let mass = pc.sum_keepdim(D::Minus1)?; // [Hq, T, 1]
                oc = oc.broadcast_add(&mass.broadcast_mul(&self.per_q_head(mu, hq)?.unsqueeze(1)?)?)?;
            }
            out = (out + oc)?;
        }
        if let Some(v) = exact_kv {
            let pe = p.narrow(2, s, e)?.reshape((self.n_kv, g * t, e))?;
            out = (out + pe.matmul(&v)?.reshape((hq, t, d))?)?;
        }
        Ok(out.unsqueeze(0)?)
    }
}

impl LayerCache for PortableVecInferCache {
    fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        let (_, h, t, d) = k.dims4()?;
        if h != self.n_kv || d != self.head_dim {
            return Err(Error::Config(format!("cache built for {}×{}, got {h}×{d}", self.n_kv, self.head_dim)));
        }
        let tm = |x: &Tensor| -> Result<Tensor> { Ok(x.squeeze(0)?.transpose(0, 1)?.to_dtype(DType::F16)?.contiguous()?) };
        let (k, v) = (tm(k)?, tm(v)?);
        let to_sink = (self.cfg.sink - rows(&self.sink)).min(t);
        if to_sink > 0 {
            self.sink = Some(cat_opt(&self.sink, k.narrow(0, 0, to_sink)?, v.narrow(0, 0, to_sink)?)?);
        }
        if t > to_sink {
            self.window = Some(cat_opt(&self.window, k.narrow(0, to_sink, t - to_sink)?, v.narrow(0, to_sink, t - to_sink)?)?);
        }
        Ok(())
    }

    fn attend(&mut self, q: &Tensor, scale: f64) -> Result<Tensor> {
        let y = self.attend_all(q, scale)?;
        self.flush()?;
        Ok(y)
    }

    fn len(&self) -> usize {
        rows(&self.sink) + self.coded + rows(&self.window)
    }

    fn resident_bytes(&self) -> usize {
        let bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let codes: usize = self.key_codes.iter().chain(&self.value_codes).map(bytes).sum();
        let f16: usize = [&self.sink, &self.window].iter().filter_map(|x| x.as_ref()).map(|(k, v)| bytes(k) + bytes(v)).sum();
        codes + f16 + self.keys.resident_bytes() + self.values.resident_bytes()
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        if len > self.len() {
            return Err(Error::Config(format!("truncate to {len} beyond the {} cached positions", self.len())));
        }
        let ns = rows(&self.sink);
        let cut = |x: &Option<(Tensor, Tensor)>, n: usize| -> Result<Option<(Tensor, Tensor)>> {
            Ok(match x {
                Some((k, v)) if n > 0 => Some((k.narrow(0, 0, n)?, v.narrow(0, 0, n)?)),
                _ => None,
            })
        };
        if len <= ns {
            self.sink = cut(&self.sink, len)?;
            (self.window, self.coded) = (None, 0);
            self.key_codes.clear();
            self.value_codes.clear();
        } else if len - ns >= self.coded {
            self.window = cut(&self.window, len - ns - self.coded)?;
        } else {
            // Keep whole blocks; the kept part of the cut block goes back to the window, decoded.
            let b = self.cfg.flush_block;
            let (keep, part) = ((len - ns) / b, (len - ns) % b);
            self.window = if part > 0 {
                let dk = self.keys.decode(&self.key_codes[keep].narrow(0, 0, part)?)?.to_dtype(DType::F16)?;
                let dv = self.values.decode(&self.value_codes[keep].narrow(0, 0, part)?)?.to_dtype(DType::F16)?;
                Some((dk, dv))
            } else {
                None
            };
            self.key_codes.truncate(keep);
            self.value_codes.truncate(keep);
            self.coded = keep * b;
        }
        Ok(())
    }
    fn commit(&mut self) -> Result<()> {
        self.flush()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::cache::VecInferCache;
    use veloq::calibrate::{train_codec, KMeansConfig};
    use veloq::codec::codebook::{Granularity, PqShape};
    use veloq::codec::pack::unpack;
    use veloq::codec::vecinfer::CodecSpec;
    use crate::testing::{fresh_seed, randn};

    fn codecs(seed: u64, h: usize, d: usize, sd: usize, bits: u32, g: Granularity) -> (VecInferCodec, VecInferCodec) {
        let shape = PqShape::new(sd, bits).unwrap();
        let train = randn(500 * h * d, seed, true);
        let k = train_codec(&train, h, d, &CodecSpec { granularity: g, ..CodecSpec::keys(shape) }, &KMeansConfig::new(1 << bits, 1)).unwrap().0;
        let v = train_codec(&train, h, d, &CodecSpec { granularity: g, ..CodecSpec::values(shape) }, &KMeansConfig::new(1 << bits, 2)).unwrap().0;
        (k, v)
    }

    /// Tensor-op quantize gives the fused CPU kernel's codes (up to near-ties) for per-layer and
    /// per-sub-space books, and decode matches the CPU decoder.
    #[test]
    fn quantize_and_decode_match_the_cpu_codec() {
        let seed = fresh_seed();
        let dev = Device::Cpu;
        for (sd, bits, g) in [(4, 8, Granularity::PerLayer), (8, 6, Granularity::PerSubspace), (2, 8, Granularity::PerLayer)] {
            let (h, d, t) = (3, 64, 57);
            let (kc, _) = codecs(seed, h, d, sd, bits, g);
            let pc = PortableCodec::new(&kc, &dev).unwrap();
            let x = randn(t * h * d, seed + 9, true);
            let got = pc.quantize(&Tensor::from_slice(&x, (t, h, d), &dev).unwrap()).unwrap();
            let got: Vec<u32> = got.to_dtype(DType::U32).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            let mut want = vec![0u16; got.len()];
            unpack(&kc.encode_vec(&x).unwrap(), bits, &mut want).unwrap();
            let differ = got.iter().zip(&want).filter(|(a, b)| **a != **b as u32).count();
            assert!(differ * 1000 <= got.len(), "seed {seed} sd {sd}: {differ} of {} codes differ", got.len());
            let codes = Tensor::from_vec(want.iter().map(|&c| c as u32).collect::<Vec<_>>(), (t, h, d / sd), &dev).unwrap();
            let dec: Vec<f32> = pc.decode(&codes).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            let mut cpu = vec![0.0f32; x.len()];
            kc.decode(&kc.encode_vec(&x).unwrap(), &mut cpu).unwrap();
            let err = dec.iter().zip(&cpu).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(err < 1e-4, "seed {seed}: decode differs by {err}");
        }
    }

    /// The portable cache attends like the fused CPU cache: a prefill, then decode steps that flush
    /// codes, then a truncation into the codes, GQA throughout.
    #[test]
    fn attention_matches_the_fused_cache() {
        let seed = fresh_seed();
        let dev = Device::Cpu;
        let (hkv, hq, d) = (2, 6, 64);
        let (kc, vc) = codecs(seed, hkv, d, 4, 8, Granularity::PerLayer);
        let cfg = WindowConfig { window: 8, flush_block: 8, sink: 2 };
        let mut fused = VecInferCache::new(Arc::new(kc.clone()), Arc::new(vc.clone()), cfg).unwrap();
        let mut port = PortableVecInferCache::new(&kc, &vc, cfg, &dev).unwrap();
        let step = |t: usize, n: u64, fused: &mut VecInferCache, port: &mut PortableVecInferCache| {
            let k = Tensor::from_vec(randn(hkv * t * d, seed + 3 * n, true), (1, hkv, t, d), &dev).unwrap();
            let v = Tensor::from_vec(randn(hkv * t * d, seed + 3 * n + 1, true), (1, hkv, t, d), &dev).unwrap();
            let q = Tensor::from_vec(randn(hq * t * d, seed + 3 * n + 2, true), (1, hq, t, d), &dev).unwrap();
            fused.append(&k, &v).unwrap();
            port.append(&k, &v).unwrap();
            let a: Vec<f32> = fused.attend(&q, 0.125).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            let b: Vec<f32> = port.attend(&q, 0.125).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            let err: f32 = a.iter().zip(&b).map(|(x, y)| (x - y).powi(2)).sum::<f32>().sqrt();
            let norm: f32 = a.iter().map(|x| x * x).sum::<f32>().sqrt();
            assert!(err <= 1e-3 * norm, "seed {seed} step {n}: rel err {}", err / norm);
            assert_eq!(fused.len(), port.len());
        };
        step(37, 0, &mut fused, &mut port);
        for n in 1..20 {
            step(1, n, &mut fused, &mut port);
        }
        step(5, 20, &mut fused, &mut port);
        assert!(port.coded > 0 && port.resident_bytes() > 0);
        fused.truncate(29).unwrap();
        port.truncate(29).unwrap();
        for n in 21..25 {
            step(1, n, &mut fused, &mut port);
        }
    }
}
