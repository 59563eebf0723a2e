//! The forward pass's weight matrices: candle's quantized matmul, except for Q4_1 weights on the
//! CPU, which go to veloq's kernel (`veloq::kernels::cpu::q4_1`: candle has no SIMD path for
//! Q4_1, and SmolLM2's common GGUF is Q4_1), and f16 weights on CUDA applied to a decode step's
//! one row, which go to veloq's GEMV (`veloq::kernels::cuda::gemv_f16`: one launch with f32 in
//! and out, where candle's path is cast, cuBLAS GEMM, cast; on an H200 it still reads the weights
//! at 1.75–2.9 TB/s, well below the copy bandwidth).

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Module, Tensor};

use crate::error::Result;

pub(crate) enum Linear {
    Candle(QMatMul),
    /// `rows × cols` weights as Q4_1 blocks, row after row.
    Q41 {
        blocks: Vec<u8>,
        rows: usize,
        cols: usize,
    },
}

impl Linear {
    /// A GGUF weight `[rows, cols]`; `CANDLE_DEQUANTIZE_ALL` still means f32 weights everywhere.
    pub(crate) fn new(q: QTensor) -> Result<Self> {
        let q = Arc::new(q);
        let mm = QMatMul::from_arc(q.clone())?;
        let own = matches!(mm, QMatMul::QTensor(_))
            && q.device().is_cpu()
            && q.dtype() == GgmlDType::Q4_1
            && q.shape().rank() == 2
            && q.shape().dims()[1].is_multiple_of(veloq::kernels::cpu::q4_1::BLOCK);
        if !own {
            return Ok(Linear::Candle(mm));
        }
        let (rows, cols) = q.shape().dims2()?;
        drop(mm);
        Ok(Linear::Q41 { blocks: q.data()?.into_owned(), rows, cols })
    }

    /// Bytes of the weights as stored (what one pass over them reads).
    pub(crate) fn bytes(&self) -> usize {
        match self {
            Linear::Candle(QMatMul::QTensor(q)) => q.storage_size_in_bytes(),
            Linear::Candle(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => t.elem_count() * t.dtype().size_in_bytes(),
            Linear::Q41 { blocks, .. } => blocks.len(),
        }
    }
}

impl From<QMatMul> for Linear {
    fn from(q: QMatMul) -> Self {
        Linear::Candle(q)
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            #[cfg(feature = "cuda")]
            Linear::Candle(QMatMul::TensorF16(w)) if gemv::applies(x, w) => gemv::forward(x, w),
            Linear::Candle(q) => q.forward(x),
            Linear::Q41 { blocks, rows, cols } => {
                let mut dims = x.dims().to_vec();
                let k = dims.pop().unwrap_or(0);
                if k != *cols {
                    candle_core::bail!("Q4_1 weights [{rows}, {cols}] applied to activations {:?}", x.shape());
                }
                let n = x.elem_count() / k.max(1);
                let xs = x.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                let mut out = vec![0f32; n * rows];
                veloq::kernels::cpu::q4_1::matmul(&xs, n, k, blocks, *rows, &mut out)
                    .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
                dims.push(*rows);
                Tensor::from_vec(out, dims, x.device())
            }
        }
    }
}

/// veloq's f16 GEMV on CUDA for a few activation rows.
#[cfg(feature = "cuda")]
pub(crate) mod gemv {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, OnceLock};

    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::CudaStorage;
    use candle_core::{DType, Layout, Shape, Tensor};
    use half::f16;
    use veloq::kernels::cuda::{gemv_f16, GemvTune, GEMV_MAX_ROWS};

    use crate::cache::CudaRuntime;

    /// On unless `VELOQ_CUDA_GEMV=0` (or [`set`]): off, f16 weights take candle's matmul.
    fn switch() -> &'static AtomicBool {
        static ON: OnceLock<AtomicBool> = OnceLock::new();
        ON.get_or_init(|| AtomicBool::new(std::env::var("VELOQ_CUDA_GEMV").map_or(true, |v| v != "0")))
    }

    pub fn set(on: bool) {
        switch().store(on, Ordering::Relaxed)
    }

    pub(crate) fn enabled() -> bool {
        switch().load(Ordering::Relaxed)
    }

    /// Activation rows up to which the GEMV replaces cuBLAS. The kernel takes up to
    /// [`GEMV_MAX_ROWS`], but at 8 rows it re-reads each activation chunk from L1 for every few
    /// weight rows and measured slower than cuBLAS (8B geometry, batch 8: 11.5 vs 8.6 ms a step).
    const ROWS: usize = 1;

    /// f32 activations of at most [`ROWS`] rows on CUDA, rows a multiple of 8 long.
    pub(super) fn applies(x: &Tensor, w: &Tensor) -> bool {
        let k = x.dims().last().copied().unwrap_or(0);
        enabled()
            && x.device().is_cuda()
            && x.dtype() == DType::F32
            && w.dtype() == DType::F16
            && w.rank() == 2
            && w.dims()[1] == k
            && k.is_multiple_of(8)
            && w.is_contiguous()
            && (1..=ROWS.min(GEMV_MAX_ROWS)).contains(&(x.elem_count() / k.max(1)))
    }

    pub(super) fn forward(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
        let mut dims = x.dims().to_vec();
        let k = dims.pop().unwrap_or(0);
        let rows = x.elem_count() / k;
        let rt = CudaRuntime::new(x.device()).map_err(candle_core::Error::wrap)?;
        let y = x.reshape((rows, k))?.contiguous()?.apply_op2_no_bwd(w, &Gemv { rt })?;
        dims.push(w.dims()[0]);
        y.reshape(dims)
    }

    struct Gemv {
        rt: Arc<CudaRuntime>,
    }

    impl candle_core::CustomOp2 for Gemv {
        fn name(&self) -> &'static str {
            "veloq-f16-gemv"
        }

        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &Layout,
            _: &candle_core::CpuStorage,
            _: &Layout,
        ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
            candle_core::bail!("veloq's f16 GEMV runs on CUDA only")
        }

        fn cuda_fwd(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            w: &CudaStorage,
            wl: &Layout,
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            let ((b, k), (n, _)) = (xl.shape().dims2()?, wl.shape().dims2()?);
            let (Some((x0, x1)), Some((w0, w1))) = (xl.contiguous_offsets(), wl.contiguous_offsets()) else {
                candle_core::bail!("veloq's f16 GEMV takes contiguous operands");
            };
            let xv = x.as_cuda_slice::<f32>()?.slice(x0..x1);
            let wv = w.as_cuda_slice::<f16>()?.slice(w0..w1);
            // SAFETY: f16 and u16 have the same size and alignment; the kernel reads f16 bits.
            let wv = unsafe { wv.transmute::<u16>(wv.len()) }.expect("same size");
            let dev = x.device().clone();
            // SAFETY: the kernel writes every one of the b·n outputs before anything reads them.
            let mut y = unsafe { dev.alloc::<f32>(b * n) }?;
            gemv_f16(self.rt.gpu(), &wv, &xv, &mut y.as_view_mut(), b, n, k, GemvTune::for_rows(b))
                .map_err(candle_core::Error::wrap)?;
            Ok((CudaStorage::wrap_cuda_slice(y, dev), Shape::from((b, n))))
        }
    }
}
