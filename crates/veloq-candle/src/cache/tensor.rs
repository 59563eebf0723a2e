//! The fp16 baseline on any candle device (the CUDA runner's reference cache): keys and values in
//! one preallocated `[2, batch, n_kv, capacity, head_dim]` f16 tensor, so appending writes only the
//! new positions and memory is what a serving engine reserves for the context (llama.cpp's
//! `n_ctx`). On CUDA (feature `cuda`) appends are one kernel launch and decode attention is
//! flash-decoding over the f16 rows (veloq's `dense.cu`); elsewhere, and for prefill, attention is
//! candle's: two batched matmuls with an f32 softmax between, query heads grouped onto their kv
//! head by reshape (keys are never copied per query head).

use candle_core::{DType, Device, Tensor};

use super::LayerCache;
use crate::error::{Error, Result};

pub struct TensorCache {
    /// Keys then values, `[2, B, n_kv, capacity, D]` f16.
    kv: Tensor,
    len: usize,
    launches: usize,
    #[cfg(feature = "cuda")]
    kernels: Option<super::cuda::DenseKernels>,
}

impl TensorCache {
    /// An empty cache for `capacity` positions of `batch` sequences (allocated now), attended by
    /// `q_heads` query heads.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub fn new(batch: usize, n_kv: usize, head_dim: usize, capacity: usize, q_heads: usize, device: &Device) -> Result<Self> {
        if batch == 0 || n_kv == 0 || head_dim == 0 || capacity == 0 {
            return Err(Error::Config(format!("fp16 cache of {batch}×{n_kv}×{capacity}×{head_dim}: every size must be positive")));
        }
        Ok(Self {
            kv: Tensor::zeros((2, batch, n_kv, capacity, head_dim), DType::F16, device)?,
            len: 0,
            launches: 0,
            #[cfg(feature = "cuda")]
            kernels: super::cuda::DenseKernels::new(device, q_heads, n_kv, head_dim)?,
        })
    }

    /// (batch, n_kv, capacity, head_dim)
    fn dims(&self) -> (usize, usize, usize, usize) {
        let (_, b, h, c, d) = self.kv.dims5().expect("the cache tensor is rank 5");
        (b, h, c, d)
    }
}

/// Causal GQA attention of `q` (`[B, Hq, T, D]`) over the first `len` positions of `k`/`v`
/// (`[B, Hkv, ≥len, D]`, any float dtype): query `i` sees positions `0..=len − T + i`. Computed in
/// f32 (keys and values widened): f16 scores lose too much on models with outlier keys (SmolLM2's
/// sink scores reach ~100, where f16 steps by 0.06). Returns f32 `[B, Hq, T, D]`.
pub fn attend_tensors(q: &Tensor, k: &Tensor, v: &Tensor, len: usize, scale: f64) -> Result<Tensor> {
    let (b, hq, t, d) = q.dims4()?;
    let n_kv = k.dim(1)?;
    let g = hq / n_kv;
    let (k, v) = (k.narrow(2, 0, len)?.to_dtype(DType::F32)?, v.narrow(2, 0, len)?.to_dtype(DType::F32)?);
    let qg = (q.to_dtype(DType::F32)? * scale)?.reshape((b, n_kv, g * t, d))?;
    let att = qg.matmul(&k.t()?)?; // [B, Hkv, G·T, len]
    let att = if t > 1 {
        let mask: Vec<f32> = (0..t).flat_map(|i| (0..len).map(move |j| if j + t > len + i { f32::NEG_INFINITY } else { 0.0 })).collect();
        let mask = Tensor::from_vec(mask, (t, len), q.device())?;
        att.reshape((b, n_kv, g, t, len))?.broadcast_add(&mask)?.reshape((b, n_kv, g * t, len))?
    } else {
        att
    };
    let p = candle_nn::ops::softmax_last_dim(&att)?;
    Ok(p.matmul(&v)?.reshape((b, hq, t, d))?)
}

/// Candle ops [`attend_tensors`] issues for one decode query (narrows and reshapes launch nothing):
/// two widenings, the query's scale, two matmuls, the softmax.
const DECODE_OPS: usize = 6;

impl LayerCache for TensorCache {
    fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        let (b, h, cap, d) = self.dims();
        let (kb, kh, t, kd) = k.dims4()?;
        if (kb, kh, kd) != (b, h, d) || v.dims4()? != (kb, kh, t, kd) {
            return Err(Error::Config(format!("fp16 cache holds {b}×{h}×{d}, got keys {:?} and values {:?}", k.dims(), v.dims())));
        }
        if self.len + t > cap {
            return Err(Error::ContextOverflow { requested: self.len + t, max: cap });
        }
        #[cfg(feature = "cuda")]
        if let Some(kernels) = &self.kernels {
            kernels.append(&self.kv, k, v, self.len)?;
            self.len += t;
            self.launches += 1;
            return Ok(());
        }
        let kv = Tensor::stack(&[k.to_dtype(DType::F16)?, v.to_dtype(DType::F16)?], 0)?;
        self.kv.slice_set(&kv, 3, self.len)?;
        self.len += t;
        self.launches += 4;
        Ok(())
    }

    fn attend(&mut self, q: &Tensor, scale: f64) -> Result<Tensor> {
        let (b, h, _, d) = self.dims();
        let (qb, hq, t, qd) = q.dims4()?;
        if qb != b || qd != d || hq % h != 0 || t > self.len {
            return Err(Error::Config(format!("fp16 cache of {b}×{h}×{d} with {} positions cannot attend queries {:?}", self.len, q.dims())));
        }
        #[cfg(feature = "cuda")]
        if let (Some(kernels), 1) = (&self.kernels, t) {
            self.launches += 2;
            return kernels.attend(q, &self.kv, self.len, scale);
        }
        self.launches += DECODE_OPS + usize::from(t > 1) * 2;
        attend_tensors(q, &self.kv.get(0)?, &self.kv.get(1)?, self.len, scale)
    }

    fn len(&self) -> usize {
        self.len
    }

    /// The whole reservation (capacity, both tensors), whatever is filled.
    fn resident_bytes(&self) -> usize {
        self.kv.elem_count() * 2
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        if len > self.len {
            return Err(Error::Config(format!("cannot truncate {} positions to {len}", self.len)));
        }
        self.len = len;
        Ok(())
    }

    fn launches(&self) -> usize {
        self.launches
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::Fp16Cache;
    use crate::testing::rand_tensor;

    /// ‖a − b‖ / ‖b‖
    fn rel_err(a: &Tensor, b: &Tensor) -> f32 {
        let num = (a - b).unwrap().sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
        (num / b.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap()).sqrt()
    }

    /// Same attention as the CPU reference cache, prefill then single tokens, batch 1; and each
    /// sequence of a batch of 3 attends like that sequence alone.
    #[test]
    fn matches_the_cpu_reference_and_batches() {
        let dev = Device::Cpu;
        let (h, hq, d) = (2, 6, 32);
        let mut refc = Fp16Cache::new(h, d);
        let mut c = TensorCache::new(1, h, d, 64, hq, &dev).unwrap();
        for (step, t) in [7usize, 1, 1, 5, 1].into_iter().enumerate() {
            let k = rand_tensor(&[1, h, t, d], 10 + step as u64);
            let v = rand_tensor(&[1, h, t, d], 20 + step as u64);
            let q = rand_tensor(&[1, hq, t, d], 30 + step as u64);
            refc.append(&k, &v).unwrap();
            c.append(&k, &v).unwrap();
            let a = refc.attend(&q, 0.3).unwrap();
            let b = c.attend(&q, 0.3).unwrap();
            // Both attend over the same f16-stored keys and values in f32.
            let err = rel_err(&b, &a);
            assert!(err < 1e-5, "step {step}: relative error {err}");
        }
        assert_eq!(c.len(), 15);
        let mut cb = TensorCache::new(3, h, d, 16, hq, &dev).unwrap();
        let (k, v) = (rand_tensor(&[3, h, 9, d], 1), rand_tensor(&[3, h, 9, d], 2));
        let q = rand_tensor(&[3, hq, 1, d], 3);
        cb.append(&k, &v).unwrap();
        let all = cb.attend(&q, 0.2).unwrap();
        for s in 0..3 {
            let mut one = TensorCache::new(1, h, d, 16, hq, &dev).unwrap();
            one.append(&k.narrow(0, s, 1).unwrap(), &v.narrow(0, s, 1).unwrap()).unwrap();
            let o = one.attend(&q.narrow(0, s, 1).unwrap(), 0.2).unwrap();
            let err = rel_err(&all.narrow(0, s, 1).unwrap(), &o);
            assert!(err < 1e-5, "sequence {s}: {err}");
        }
        let over = cb.append(&rand_tensor(&[3, h, 8, d], 4), &rand_tensor(&[3, h, 8, d], 5)).unwrap_err();
        assert!(matches!(over, Error::ContextOverflow { requested: 17, max: 16 }), "{over}");
    }
}

