//! A many-row layer step (a prompt chunk, a batch past the GEMV's rows) over f16 weights on CUDA:
//! cuBLAS multiplies f16 activations into f16 outputs, and veloq's row kernels do the work between
//! the products — the norms write f16, the gated activation reads and writes f16, and the output
//! and down products are added into the f32 residual stream where it lies. candle's path casts
//! on both sides of every product (two launches and a pass over the activations each) and runs
//! the activation and the adds in f32; the arithmetic here is the same, rounded to f16 where that
//! path casts.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::CudaStorage;
use candle_core::{CpuStorage, DType, Layout, Shape, Tensor};
use candle_nn::RmsNorm;
use half::f16;
use veloq::kernels::cuda::{rows_add_f16, rows_gated_f16, rows_norm_f16, GatedActivation, GEMV_MAX_ROWS};

use super::arch::Activation;
use super::linear::gemv::{cuda_slice, cuda_view};
use super::linear::Linear;
use crate::cache::CudaRuntime;

/// Whether the residual stream `x` takes this path: `[rows, hidden]` f32 on a CUDA device whose
/// runtime has it on ([`CudaOptions::f16_rows`](crate::runtime::CudaOptions::f16_rows)), more
/// rows than veloq's GEMV takes (a decode step's few rows keep the GEMV, norms and activations
/// fused into its launches) or the GEMV off.
pub(crate) fn applies(x: &Tensor) -> bool {
    x.dtype() == DType::F32
        && x.rank() == 2
        && CudaRuntime::new(x.device()).is_ok_and(|rt| rt.f16_rows() && (x.dims()[0] > GEMV_MAX_ROWS || !rt.gemv()))
}

/// The f16 matrices of `ws`, when every one is an f16 weight on CUDA.
pub(crate) fn weights<'a>(ws: &[&'a Linear]) -> Option<Vec<&'a Tensor>> {
    ws.iter().map(|w| w.f16_cuda()).collect()
}

/// `f16(rmsnorm(x))`, `[rows, hidden]`; `None` where the norm's weight is not f32 `[hidden]`.
pub(crate) fn norm(x: &Tensor, m: &RmsNorm) -> candle_core::Result<Option<Tensor>> {
    let (w, k) = (m.weight(), x.dim(1)?);
    if w.dtype() != DType::F32 || w.dims() != [k] || !w.device().same_device(x.device()) {
        return Ok(None);
    }
    let op = Norm { w: w.contiguous()?, eps: m.eps() as f32, rt: runtime(x)? };
    Ok(Some(x.contiguous()?.apply_op1_no_bwd(&op)?))
}

/// `h · wᵀ` in f16 (`h` `[rows, k]` f16, `w` `[n, k]` f16): cuBLAS, no casts.
pub(crate) fn product(h: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    h.matmul(&w.t()?)
}

/// `f16(act(gate) · up)` of two f16 products of one shape.
pub(crate) fn gated(gate: &Tensor, up: &Tensor, act: Activation) -> candle_core::Result<Tensor> {
    let act = match act {
        Activation::Silu => GatedActivation::Silu,
        Activation::GeluTanh => GatedActivation::GeluTanh,
    };
    let op = Gated { act, rt: runtime(gate)? };
    gate.contiguous()?.apply_op2_no_bwd(&up.contiguous()?, &op)
}

/// `x += y` (`x` the f32 residual stream, `y` an f16 product of its shape), in place; returns `x`.
pub(crate) fn add_into(x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
    x.inplace_op2(&y.contiguous()?, &AddInto { rt: runtime(x)? })?;
    Ok(x.clone())
}

fn runtime(t: &Tensor) -> candle_core::Result<Arc<CudaRuntime>> {
    CudaRuntime::new(t.device()).map_err(candle_core::Error::wrap)
}

fn not_on_cpu<T>() -> candle_core::Result<T> {
    candle_core::bail!("veloq's row kernels run on CUDA only")
}

/// f16 bits of an f16 view (the kernels read and write `unsigned short`).
fn bits<'a>(v: &'a cudarc::driver::CudaView<'a, f16>) -> cudarc::driver::CudaView<'a, u16> {
    // SAFETY: f16 and u16 have the same size and alignment.
    unsafe { v.transmute::<u16>(v.len()) }.expect("same size")
}

fn veloq_err(e: veloq::Error) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

struct Norm {
    w: Tensor,
    eps: f32,
    rt: Arc<CudaRuntime>,
}

impl candle_core::CustomOp1 for Norm {
    fn name(&self) -> &'static str {
        "veloq-rows-norm-f16"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        not_on_cpu()
    }

    fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let (rows, k) = xl.shape().dims2()?;
        let (ws, wl) = self.w.storage_and_layout();
        let dev = x.device().clone();
        // SAFETY: the kernel writes every one of the rows·k outputs before anything reads them.
        let mut out = unsafe { dev.alloc::<f16>(rows * k) }?;
        {
            let mut o = out.as_view_mut();
            // SAFETY: f16 and u16 have the same size and alignment.
            let mut o = unsafe { o.transmute_mut::<u16>(rows * k) }.expect("same size");
            let (xv, wv) = (cuda_slice::<f32>(x, xl)?, cuda_view::<f32>(&ws, wl)?);
            rows_norm_f16(self.rt.gpu(), &xv, &wv, &mut o, rows, k, self.eps).map_err(veloq_err)?;
        }
        Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((rows, k))))
    }
}

struct Gated {
    act: GatedActivation,
    rt: Arc<CudaRuntime>,
}

impl candle_core::CustomOp2 for Gated {
    fn name(&self) -> &'static str {
        "veloq-rows-gated-f16"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        not_on_cpu()
    }

    fn cuda_fwd(
        &self,
        g: &CudaStorage,
        gl: &Layout,
        u: &CudaStorage,
        ul: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        if gl.shape() != ul.shape() {
            candle_core::bail!("gate {:?} and up {:?} products differ", gl.shape(), ul.shape());
        }
        let n = gl.shape().elem_count();
        let dev = g.device().clone();
        // SAFETY: the kernel writes every one of the n outputs before anything reads them.
        let mut out = unsafe { dev.alloc::<f16>(n) }?;
        {
            let mut o = out.as_view_mut();
            // SAFETY: f16 and u16 have the same size and alignment.
            let mut o = unsafe { o.transmute_mut::<u16>(n) }.expect("same size");
            let (gv, uv) = (cuda_slice::<f16>(g, gl)?, cuda_slice::<f16>(u, ul)?);
            rows_gated_f16(self.rt.gpu(), &bits(&gv), &bits(&uv), &mut o, n, self.act).map_err(veloq_err)?;
        }
        Ok((CudaStorage::wrap_cuda_slice(out, dev), gl.shape().clone()))
    }
}

struct AddInto {
    rt: Arc<CudaRuntime>,
}

impl candle_core::InplaceOp2 for AddInto {
    fn name(&self) -> &'static str {
        "veloq-rows-add-f16"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> candle_core::Result<()> {
        not_on_cpu()
    }

    fn cuda_fwd(&self, x: &mut CudaStorage, xl: &Layout, y: &CudaStorage, yl: &Layout) -> candle_core::Result<()> {
        let n = xl.shape().elem_count();
        if yl.shape() != xl.shape() {
            candle_core::bail!("adding {:?} into the stream {:?}", yl.shape(), xl.shape());
        }
        let Some((a, b)) = xl.contiguous_offsets() else {
            candle_core::bail!("veloq's row kernels add into a contiguous stream");
        };
        let yv = cuda_slice::<f16>(y, yl)?;
        let mut xv = x.as_cuda_slice_mut::<f32>()?.slice_mut(a..b);
        rows_add_f16(self.rt.gpu(), &mut xv, &bits(&yv), n).map_err(veloq_err)
    }
}
