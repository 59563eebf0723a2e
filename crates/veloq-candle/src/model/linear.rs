//! The forward pass's weight matrices: candle's quantized matmul, except for Q4_1 and Q8_0
//! weights on the CPU, which go to veloq's kernel (`veloq::kernels::cpu::quant`: candle has no
//! SIMD path for Q4_1, SmolLM2's common GGUF is Q4_1, and its Q8_0 output matrix ran on candle's
//! one thread), and f16 weights on CUDA applied to a decode step's
//! rows (1–8), which go to veloq's GEMV (`veloq::kernels::cuda::gemv_f16_many`: one launch, f32 in
//! and out, where candle's path is cast, cuBLAS GEMM, cast). [`Linear::fused`] also folds the
//! norms, RoPE, residual adds and gated MLP around a layer's products into them: an 8B layer is
//! four launches that read each weight once, and writes q/k/v into a buffer the caller names (a
//! CUDA graph's).

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul};
use candle_core::{DType, Device, Module, Tensor};
use veloq::kernels::cpu::quant::{self, Format};

use super::decoder::Weights;
use super::source::Weight;
use crate::error::Result;

pub(crate) enum Linear {
    Candle(QMatMul),
    /// GGUF blocks repacked for veloq's CPU kernel.
    Blocks(quant::Packed),
}

impl Linear {
    /// A weight `[rows, cols]` on `device`. Quantized blocks stay blocks (Q4_1 on the CPU in
    /// veloq's layout) unless `weights` says to dequantize them (f16: the float path below; f32:
    /// the same arithmetic on every device); float weights become f16 on CUDA (veloq's GEMV reads
    /// them) and f32 on the CPU.
    pub(crate) fn new(w: Weight, device: &Device, weights: Weights) -> Result<Self> {
        let q = match w {
            Weight::Dense(t) if device.is_cuda() => {
                return Ok(Linear::Candle(QMatMul::TensorF16(t.to_dtype(DType::F16)?)))
            }
            Weight::Dense(t) => return Ok(Linear::Candle(QMatMul::Tensor(t.to_dtype(DType::F32)?))),
            Weight::Quantized(q) => q,
        };
        match q.dtype() {
            GgmlDType::F16 | GgmlDType::BF16 | GgmlDType::F32 if device.is_cuda() => {
                return Ok(Linear::Candle(QMatMul::TensorF16(q.dequantize_f16(device)?)))
            }
            GgmlDType::F16 | GgmlDType::BF16 | GgmlDType::F32 => {
                return Ok(Linear::Candle(QMatMul::Tensor(q.dequantize(device)?)))
            }
            _ if weights == Weights::F32 => return Ok(Linear::Candle(QMatMul::Tensor(q.dequantize(device)?))),
            _ if weights == Weights::F16 => return Ok(Linear::Candle(QMatMul::TensorF16(q.dequantize_f16(device)?))),
            _ => {}
        }
        let format = match q.dtype() {
            GgmlDType::Q4_1 => Some(Format::Q4_1),
            GgmlDType::Q8_0 => Some(Format::Q8_0),
            _ => None,
        };
        let own = device.is_cpu() && q.shape().rank() == 2 && q.shape().dims()[1].is_multiple_of(quant::BLOCK);
        match format {
            Some(format) if own => {
                let (rows, cols) = q.shape().dims2()?;
                let packed = quant::Packed::new(format, &q.data()?, rows, cols)
                    .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
                Ok(Linear::Blocks(packed))
            }
            _ => Ok(Linear::Candle(QMatMul::QTensor(Arc::new(q)))),
        }
    }

    /// Matrices applied to the same activations as one, rows one after another (a layer's q, k
    /// and v; gate and up): one product and one parallel loop instead of several, where veloq's
    /// CPU kernel holds them all in one format; `None` otherwise.
    pub(crate) fn stack(ws: &[&Linear]) -> Option<Linear> {
        let packed: Option<Vec<&quant::Packed>> = ws
            .iter()
            .map(|w| match w {
                Linear::Blocks(p) => Some(p),
                Linear::Candle(_) => None,
            })
            .collect();
        quant::Packed::stack(&packed?).ok().map(Linear::Blocks)
    }

    /// Outputs per token.
    pub(crate) fn rows(&self) -> usize {
        match self {
            Linear::Candle(QMatMul::QTensor(q)) => q.shape().dims().first().copied().unwrap_or(0),
            Linear::Candle(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => t.dims().first().copied().unwrap_or(0),
            Linear::Blocks(p) => p.rows(),
        }
    }

    /// Bytes of the weights as stored (what one pass over them reads).
    pub(crate) fn bytes(&self) -> usize {
        match self {
            Linear::Candle(QMatMul::QTensor(q)) => q.storage_size_in_bytes(),
            Linear::Candle(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => t.elem_count() * t.dtype().size_in_bytes(),
            Linear::Blocks(p) => p.bytes(),
        }
    }
}

/// What a fused product of several matrices writes ([`Linear::fused`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fused {
    /// Each matrix's output (a layer's q, k, v).
    Each,
    /// `act(x·gateᵀ) ⊙ (x·upᵀ)` of two matrices, SiLU or GELU (tanh).
    GatedSilu,
    GatedGeluTanh,
}

/// The small operations a fused product takes along (read by the CUDA GEMV only).
#[derive(Clone, Copy, Default)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct Along<'a> {
    /// RMS norm of the activations first.
    pub(crate) norm: Option<&'a candle_nn::RmsNorm>,
    /// Added to the output: the residual stream, `[rows, n]`; with `in_place`, updated where it
    /// lies (the output is that tensor).
    pub(crate) residual: Option<&'a Tensor>,
    pub(crate) in_place: bool,
    /// Interleaved RoPE on the first two outputs (q, k): each row's cos and sin, `[rows, 1,
    /// head_dim / 2]`.
    pub(crate) rope: Option<(&'a Tensor, &'a Tensor)>,
    /// Written into this contiguous buffer (every output, one after another) instead of a new
    /// one: a CUDA graph's fixed buffer, so nothing copies them there after.
    pub(crate) into: Option<&'a Tensor>,
}

/// A fused product's outputs, each `[rows, n]`, and the one buffer they lie in, one after another.
pub(crate) struct Products {
    pub(crate) parts: Vec<Tensor>,
    pub(crate) flat: Tensor,
}

impl Linear {
    /// The f16 matrix cuBLAS multiplies, for f16 weights on a CUDA device.
    #[cfg(feature = "cuda")]
    pub(crate) fn f16_cuda(&self) -> Option<&Tensor> {
        match self {
            Linear::Candle(QMatMul::TensorF16(t)) if t.device().is_cuda() && t.rank() == 2 => Some(t),
            _ => None,
        }
    }

    /// Several matrices applied to `x` in one launch with `along`'s operations, written as `how`
    /// says: veloq's GEMV when every one is f16 on CUDA and the decode step's rows fit it (a
    /// layer's products and the norms, adds and RoPE around them become four launches); `None`
    /// otherwise, and the caller applies them one by one.
    pub(crate) fn fused(ws: &[&Linear], x: &Tensor, how: Fused, along: Along) -> candle_core::Result<Option<Products>> {
        #[cfg(feature = "cuda")]
        {
            let f16: Option<Vec<&Tensor>> = ws
                .iter()
                .map(|w| match w {
                    Linear::Candle(QMatMul::TensorF16(t)) => Some(t),
                    _ => None,
                })
                .collect();
            if let Some(f16) = f16 {
                return gemv::many(&f16, x, how, along);
            }
        }
        let _ = (ws, x, how, along);
        Ok(None)
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            #[cfg(feature = "cuda")]
            Linear::Candle(QMatMul::TensorF16(w)) if gemv::applies(x, w) => gemv::forward(x, w),
            Linear::Candle(q) => q.forward(x),
            Linear::Blocks(w) => {
                let mut dims = x.dims().to_vec();
                let k = dims.pop().unwrap_or(0);
                if k != w.cols() {
                    candle_core::bail!(
                        "{:?} weights [{}, {}] applied to activations {:?}",
                        w.format(),
                        w.rows(),
                        w.cols(),
                        x.shape()
                    );
                }
                let n = x.elem_count() / k.max(1);
                let xs = x.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                let mut out = vec![0f32; n * w.rows()];
                w.matmul(&xs, n, &mut out).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
                dims.push(w.rows());
                Tensor::from_vec(out, dims, x.device())
            }
        }
    }
}

/// veloq's f16 GEMV on CUDA for a few activation rows.
#[cfg(feature = "cuda")]
pub(crate) mod gemv {
    use std::sync::Arc;

    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::CudaStorage;
    use candle_core::{DType, Layout, Shape, Tensor};
    use half::f16;
    use veloq::kernels::cuda::{gemv_f16_many, gemv_many_fits, GemvEpilogue, GemvFused, GemvTune, GEMV_MAX_ROWS};

    use super::{Along, Fused, Products};

    use crate::cache::CudaRuntime;

    /// f32 activations of at most [`GEMV_MAX_ROWS`] rows on CUDA, rows a multiple of 8 long.
    pub(super) fn applies(x: &Tensor, w: &Tensor) -> bool {
        fits(x, w) && CudaRuntime::new(x.device()).is_ok_and(|rt| rt.gemv())
    }

    /// [`applies`] but for the runtime's switch.
    fn fits(x: &Tensor, w: &Tensor) -> bool {
        let k = x.dims().last().copied().unwrap_or(0);
        x.device().is_cuda()
            && x.dtype() == DType::F32
            && w.dtype() == DType::F16
            && w.rank() == 2
            && w.dims()[1] == k
            && k.is_multiple_of(8)
            && w.is_contiguous()
            && (1..=GEMV_MAX_ROWS).contains(&(x.elem_count() / k.max(1)))
    }

    /// One matrix, nothing fused (callers checked [`applies`]).
    pub(super) fn forward(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
        match many(&[w], x, Fused::Each, Along::default())? {
            Some(mut p) => Ok(p.parts.remove(0)),
            None => candle_core::bail!("veloq's f16 GEMV does not take {:?} × {:?}", x.shape(), w.shape()),
        }
    }

    /// [`super::Linear::fused`] for f16 weights: `None` when the GEMV does not take them.
    pub(super) fn many(ws: &[&Tensor], x: &Tensor, how: Fused, along: Along) -> candle_core::Result<Option<Products>> {
        let epilogue = match how {
            Fused::Each => GemvEpilogue::Concat,
            Fused::GatedSilu => GemvEpilogue::Silu,
            Fused::GatedGeluTanh => GemvEpilogue::GeluTanh,
        };
        let mut dims = x.dims().to_vec();
        let k = dims.pop().unwrap_or(0);
        if ws.is_empty() || !ws.iter().all(|w| fits(x, w)) {
            return Ok(None);
        }
        let rt = CudaRuntime::new(x.device()).map_err(candle_core::Error::wrap)?;
        if !rt.gemv() {
            return Ok(None);
        }
        let shapes = rt.gpu().gemv_shapes();
        let rows: Vec<usize> = ws.iter().map(|w| w.dims()[0]).collect();
        let b = x.elem_count() / k;
        let n = if epilogue == GemvEpilogue::Concat { rows.iter().sum() } else { rows[0] };
        let f32_cuda = |t: &Tensor, len: usize| {
            t.device().same_device(x.device()) && t.dtype() == DType::F32 && t.is_contiguous() && t.elem_count() == len
        };
        let rope_dim = along.rope.map(|(c, _)| 2 * c.dims().last().copied().unwrap_or(0));
        let fits = gemv_many_fits(&rows, epilogue, rope_dim, GemvTune::for_rows(b, &shapes))
            && along.norm.is_none_or(|m| f32_cuda(m.weight(), k))
            && along.residual.is_none_or(|r| f32_cuda(r, b * n))
            && (!along.in_place || (along.residual.is_some() && rows.len() == 1 && along.into.is_none()))
            && along.into.is_none_or(|t| f32_cuda(t, b * n))
            && along
                .rope
                .is_none_or(|(c, s)| rope_dim.is_some_and(|d| f32_cuda(c, b * d / 2) && f32_cuda(s, b * d / 2)));
        if !fits {
            return Ok(None);
        }
        let op = Many {
            rt,
            ws: ws.iter().map(|w| (*w).clone()).collect(),
            epilogue,
            norm: along.norm.map(|m| (m.weight().clone(), m.eps() as f32)),
            residual: along.residual.filter(|_| !along.in_place).cloned(),
            rope: along.rope.map(|(c, s)| (c.clone(), s.clone())),
            accumulate: along.in_place,
        };
        let x = x.reshape((b, k))?.contiguous()?;
        if let (true, Some(r)) = (along.in_place, along.residual) {
            r.inplace_op2(&x, &op)?;
            return Ok(Some(Products { parts: vec![r.clone()], flat: r.flatten_all()? }));
        }
        let y = match along.into {
            Some(t) => {
                t.inplace_op2(&x, &op)?;
                t.flatten_all()?
            }
            None => x.apply_op1_no_bwd(&op)?,
        };
        // Matrix after matrix, each [b, n]: contiguous views.
        let outs: Vec<usize> = if epilogue == GemvEpilogue::Concat { rows } else { vec![n] };
        let mut parts = Vec::with_capacity(outs.len());
        let mut off = 0;
        for n in outs {
            let mut d = dims.clone();
            d.push(n);
            parts.push(y.narrow(0, off, b * n)?.reshape(d)?);
            off += b * n;
        }
        Ok(Some(Products { parts, flat: y }))
    }

    /// The weights and the fused operations' operands ride in the op (candle's custom ops take
    /// at most three): their storage is read-locked for the launch.
    struct Many {
        rt: Arc<CudaRuntime>,
        ws: Vec<Tensor>,
        epilogue: GemvEpilogue,
        norm: Option<(Tensor, f32)>,
        residual: Option<Tensor>,
        rope: Option<(Tensor, Tensor)>,
        /// In place: add to the target (the residual stream) rather than overwrite it.
        accumulate: bool,
    }

    /// A contiguous CUDA tensor's elements.
    pub(crate) fn cuda_view<'a, T: candle_core::cuda_backend::CudaDType>(
        st: &'a candle_core::Storage,
        l: &Layout,
    ) -> candle_core::Result<cudarc::driver::CudaView<'a, T>> {
        let candle_core::Storage::Cuda(cs) = st else {
            candle_core::bail!("veloq's CUDA kernels take CUDA operands");
        };
        cuda_slice(cs, l)
    }

    /// A contiguous CUDA storage's elements of `T`, offset by its layout.
    pub(crate) fn cuda_slice<'a, T: candle_core::cuda_backend::CudaDType>(
        cs: &'a CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<cudarc::driver::CudaView<'a, T>> {
        let Some((a, b)) = l.contiguous_offsets() else {
            candle_core::bail!("veloq's CUDA kernels take contiguous operands");
        };
        Ok(cs.as_cuda_slice::<T>()?.slice(a..b))
    }

    impl candle_core::CustomOp1 for Many {
        fn name(&self) -> &'static str {
            "veloq-f16-gemv-many"
        }

        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &Layout,
        ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
            candle_core::bail!("veloq's f16 GEMV runs on CUDA only")
        }

        fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
            let (b, _) = xl.shape().dims2()?;
            let n = self.outputs();
            let dev = x.device().clone();
            // SAFETY: the kernel writes every one of the b·n outputs before anything reads them.
            let mut y = unsafe { dev.alloc::<f32>(b * n) }?;
            self.launch(x, xl, &mut y.as_view_mut(), false)?;
            Ok((CudaStorage::wrap_cuda_slice(y, dev), Shape::from(b * n)))
        }
    }

    /// In place: the residual stream (the op's target) gains the product, or (not `accumulate`)
    /// the target, a fixed buffer, takes it.
    impl candle_core::InplaceOp2 for Many {
        fn name(&self) -> &'static str {
            "veloq-f16-gemv-in-place"
        }

        fn cpu_fwd(
            &self,
            _: &mut candle_core::CpuStorage,
            _: &Layout,
            _: &candle_core::CpuStorage,
            _: &Layout,
        ) -> candle_core::Result<()> {
            candle_core::bail!("veloq's f16 GEMV runs on CUDA only")
        }

        fn cuda_fwd(&self, r: &mut CudaStorage, rl: &Layout, x: &CudaStorage, xl: &Layout) -> candle_core::Result<()> {
            let (b, _) = xl.shape().dims2()?;
            let n = self.outputs();
            let Some((r0, r1)) = rl.contiguous_offsets().filter(|(a, z)| z - a == b * n) else {
                candle_core::bail!("veloq's f16 GEMV writes into contiguous buffers of [{b}, {n}]");
            };
            let mut y = r.as_cuda_slice_mut::<f32>()?.slice_mut(r0..r1);
            self.launch(x, xl, &mut y, self.accumulate)
        }
    }

    impl Many {
        fn outputs(&self) -> usize {
            let rows = self.ws.iter().map(|w| w.dims()[0]);
            if self.epilogue == GemvEpilogue::Concat {
                rows.sum()
            } else {
                rows.max().unwrap_or(0)
            }
        }

        /// One launch writing (or, `accumulate`, adding to) `y`; every operand's storage
        /// read-locked meanwhile.
        fn launch(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            y: &mut cudarc::driver::CudaViewMut<f32>,
            accumulate: bool,
        ) -> candle_core::Result<()> {
            let (b, k) = xl.shape().dims2()?;
            let Some((x0, x1)) = xl.contiguous_offsets() else {
                candle_core::bail!("veloq's f16 GEMV takes contiguous operands");
            };
            let guards: Vec<_> = self.ws.iter().map(|w| w.storage_and_layout()).collect();
            let mut views = Vec::with_capacity(guards.len());
            for (st, l) in &guards {
                let wv = cuda_view::<f16>(st, l)?;
                // SAFETY: f16 and u16 have the same size and alignment; the kernel reads f16 bits.
                let wv = unsafe { wv.transmute::<u16>(wv.len()) }.expect("same size");
                views.push((wv, l.shape().dims()[0]));
            }
            let norm = self.norm.as_ref().map(|(w, eps)| (w.storage_and_layout(), *eps));
            let residual = self.residual.as_ref().map(|r| r.storage_and_layout());
            let rope = self.rope.as_ref().map(|(c, s)| (c.storage_and_layout(), s.storage_and_layout()));
            let norm_v = norm
                .as_ref()
                .map(|((st, l), eps)| Ok::<_, candle_core::Error>((cuda_view::<f32>(st, l)?, *eps)))
                .transpose()?;
            let residual_v = residual.as_ref().map(|(st, l)| cuda_view::<f32>(st, l)).transpose()?;
            let rope_v = rope
                .as_ref()
                .map(|((cs, cl), (ss, sl))| {
                    let d = 2 * cl.shape().dims().last().copied().unwrap_or(0);
                    Ok::<_, candle_core::Error>((cuda_view::<f32>(cs, cl)?, cuda_view::<f32>(ss, sl)?, d))
                })
                .transpose()?;
            let fused = GemvFused {
                norm: norm_v.as_ref().map(|(v, eps)| (v, *eps)),
                residual: residual_v.as_ref(),
                accumulate,
                rope: rope_v.as_ref().map(|(c, s, d)| (c, s, *d)),
            };
            let xv = x.as_cuda_slice::<f32>()?.slice(x0..x1);
            let ws: Vec<_> = views.iter().map(|(v, r)| (v, *r)).collect();
            let tune = GemvTune::for_rows(b, &self.rt.gpu().gemv_shapes());
            gemv_f16_many(self.rt.gpu(), &ws, &xv, y, b, k, self.epilogue, fused, tune)
                .map_err(candle_core::Error::wrap)
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{DType, Device, Module, Tensor};

    use super::{Linear, Weights};
    use crate::model::source::Weight;
    use crate::testing::fresh_seed;

    /// Each form of a Q4_1 matrix against the f64 product of its dequantized values: stored and
    /// f32 within f32 accumulation, f16 within the rounding of activations and weights to f16
    /// (2⁻¹¹ relative each, so |Σ xw| error ≤ 2·2⁻¹¹·Σ|x||w| plus the accumulation's).
    #[test]
    fn every_weight_form_multiplies_the_stored_matrix() {
        let seed = fresh_seed();
        let (rows, cols, n) = (48usize, 96usize, 5usize);
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (rows, cols), &dev).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q4_1).unwrap();
        let wd: Vec<Vec<f32>> = q.dequantize(&dev).unwrap().to_vec2().unwrap();
        let mut state = seed | 1;
        let x: Vec<f32> = (0..n * cols)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
            })
            .collect();
        let xt = Tensor::from_vec(x.clone(), (n, cols), &dev).unwrap();
        for form in Weights::ALL {
            let q = QTensor::quantize(&w, GgmlDType::Q4_1).unwrap();
            let lin = Linear::new(Weight::Quantized(q), &dev, form).unwrap();
            let y: Vec<Vec<f32>> = lin.forward(&xt).unwrap().to_dtype(DType::F32).unwrap().to_vec2().unwrap();
            for i in 0..n {
                for (j, wj) in wd.iter().enumerate() {
                    let xi = &x[i * cols..(i + 1) * cols];
                    let want: f64 = xi.iter().zip(wj).map(|(&a, &b)| a as f64 * b as f64).sum();
                    let mag: f64 = xi.iter().zip(wj).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
                    // Stored: veloq's kernel may round a few tokens' activations to 16 bits of
                    // their block's largest |x| (half a step each, times the weight; the d·q part
                    // of a Q4_1 weight is at most |w| + |m|, bounded here by 2·max|w| of the row).
                    let wmax = wj.iter().fold(0f64, |a, &b| a.max(b.abs() as f64));
                    let rounding: f64 = xi
                        .chunks(32)
                        .map(|b| b.iter().fold(0f64, |a, &v| a.max(v.abs() as f64)) / 65534.0 * (1.0 + 1e-6))
                        .map(|step| step * 32.0 * 2.0 * wmax)
                        .sum();
                    let bound = match form {
                        Weights::F16 => 2.0 * 2f64.powi(-11) * mag + 1e-5 * mag,
                        Weights::Stored => 1e-5 * mag + 1e-6 + rounding,
                        Weights::F32 => 1e-5 * mag + 1e-6,
                    };
                    let got = y[i][j] as f64;
                    assert!(
                        (got - want).abs() <= bound,
                        "{form}: y[{i}][{j}] = {got}, want {want} ± {bound} (seed {seed})"
                    );
                }
            }
        }
    }

    #[test]
    fn weight_forms_parse_as_they_print() {
        for w in Weights::ALL {
            assert_eq!(w.to_string().parse::<Weights>().unwrap(), w);
        }
        let e = "q4".parse::<Weights>().unwrap_err().to_string();
        assert!(e.contains("stored") && e.contains("f16"), "{e}");
    }
}
