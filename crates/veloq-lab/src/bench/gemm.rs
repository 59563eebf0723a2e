//! `veloq-lab bench gemm`: the Llama-3.1-8B geometry's weight products (`rows × k` f16 activations
//! times an `n × k` f16 weight, transposed, as the model's many-row path multiplies) through each
//! way this process can run them, side by side: candle's matmul (its cuBLAS handle as candle
//! leaves it, and with a 32 MiB workspace as PyTorch gives its handles on Hopper), `cublasGemmEx`
//! on that handle into a buffer made once (no allocation, no batched entry point), and cuBLASLt
//! with a 32 MiB workspace (cudarc's); PyTorch's rate on the same shapes from
//! `scripts/device/gemm_torch.py` (`--torch` its JSON), run in the same device call; and the rate
//! `bench serve`'s physical estimate measures ([`Rates::measure`]). Every variant's product is
//! checked against candle's.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::Args as ClapArgs;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t};
use cudarc::cublaslt::{CudaBlasLT, Matmul, MatmulConfig};
use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::f16;
use serde_json::{json, Value};

use veloq_candle::cache::CudaRuntime;
use veloq_candle::runtime::{CudaOptions, Device as VDevice};

use super::roofline::Rates;
use super::write_json;

#[derive(ClapArgs)]
pub struct Args {
    /// Activation rows (prompt tokens in a step).
    #[arg(long, value_delimiter = ',', default_value = "512,2048,4096")]
    rows: Vec<usize>,
    /// Products timed back to back between two events, per measurement (best of 5).
    #[arg(long, default_value_t = 20)]
    reps: usize,
    /// PyTorch's timings from scripts/device/gemm_torch.py, run in the same call.
    #[arg(long)]
    torch: Option<PathBuf>,
    #[arg(long)]
    json: Option<PathBuf>,
}

/// The 8B's products as (name, n, k): outputs × inputs of the weight.
const SHAPES: [(&str, usize, usize); 4] =
    [("q,o", 4096, 4096), ("k,v", 1024, 4096), ("gate,up", 14336, 4096), ("down", 4096, 14336)];

/// Seconds per call of `f`: `reps` calls queued between two events, the best of five such runs.
fn per_call(stream: &CudaStream, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..3 {
        f()?;
    }
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let a = stream.record_event(Some(CU_EVENT_DEFAULT))?;
        for _ in 0..reps {
            f()?;
        }
        let b = stream.record_event(Some(CU_EVENT_DEFAULT))?;
        b.synchronize()?;
        best = best.min(a.elapsed_ms(&b)? as f64 / 1e3 / reps as f64);
    }
    Ok(best)
}

/// Bytes of the cuBLAS workspace timed: cuBLAS's recommendation for Hopper.
const WORKSPACE: usize = 32 << 20;

/// Gives candle's cuBLAS handle `workspace`, or (`None`) returns it to cuBLAS's default pool
/// (setting the handle's stream again resets its workspace, as cuBLAS documents).
fn set_workspace(dev: &candle_core::cuda_backend::CudaDevice, workspace: Option<&CudaSlice<u8>>) -> Result<()> {
    let (blas, stream) = (dev.cublas_handle(), dev.cuda_stream());
    match workspace {
        // SAFETY: candle's live handle and the stream it was made on.
        None => unsafe { cudarc::cublas::result::set_stream(*blas.handle(), stream.cu_stream() as _)? },
        Some(w) => {
            let (ptr, _sync) = w.device_ptr(&stream);
            // SAFETY: WORKSPACE bytes of device memory that outlive every product timed with them
            // (the caller resets the handle before dropping the buffer).
            unsafe { cudarc::cublas::sys::cublasSetWorkspace_v2(*blas.handle(), ptr as *mut _, WORKSPACE) }.result()?
        }
    }
    Ok(())
}

/// `h · wᵀ` through `cublasGemmEx` on candle's handle into `out` (f32 accumulation, as candle).
fn gemm_ex(
    dev: &candle_core::cuda_backend::CudaDevice,
    h: &CudaSlice<f16>,
    w: &CudaSlice<f16>,
    out: &mut CudaSlice<f16>,
    (rows, n, k): (usize, usize, usize),
) -> Result<()> {
    let stream = dev.cuda_stream();
    let blas = dev.cublas_handle();
    let (one, zero) = (1f32, 0f32);
    let (hp, _a) = h.device_ptr(&stream);
    let (wp, _b) = w.device_ptr(&stream);
    let (op, _c) = out.device_ptr_mut(&stream);
    // Column-major: outᵀ [n × rows] = (wᵀ)ᵀ · hᵀ, w read transposed from its row-major [n, k].
    // SAFETY: the three buffers hold n·k, rows·k and rows·n f16 on the handle's stream.
    unsafe {
        cudarc::cublas::result::gemm_ex(
            *blas.handle(),
            cublasOperation_t::CUBLAS_OP_T,
            cublasOperation_t::CUBLAS_OP_N,
            n as i32,
            rows as i32,
            k as i32,
            &one as *const f32 as *const _,
            wp as *const _,
            cudaDataType_t::CUDA_R_16F,
            k as i32,
            hp as *const _,
            cudaDataType_t::CUDA_R_16F,
            k as i32,
            &zero as *const f32 as *const _,
            op as *mut _,
            cudaDataType_t::CUDA_R_16F,
            n as i32,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
        )?;
    }
    Ok(())
}

/// `h · wᵀ` through cuBLASLt (its heuristic's first choice, cudarc's 32 MiB workspace).
fn gemm_lt(
    lt: &CudaBlasLT,
    h: &CudaSlice<f16>,
    w: &CudaSlice<f16>,
    out: &mut CudaSlice<f16>,
    (rows, n, k): (usize, usize, usize),
) -> Result<()> {
    let cfg = MatmulConfig {
        transa: true,
        transb: false,
        transc: false,
        m: n as u64,
        n: rows as u64,
        k: k as u64,
        alpha: 1.0,
        lda: k as i64,
        ldb: k as i64,
        beta: 0.0,
        ldc: n as i64,
        stride_a: None,
        stride_b: None,
        stride_c: None,
        stride_bias: None,
        batch_size: None,
    };
    // SAFETY: as `gemm_ex`: the buffers hold the shapes the config names.
    unsafe { lt.matmul(cfg, w, h, out, None, None)? };
    Ok(())
}

/// The largest difference between `out` (a raw product) and candle's `want`, over `want`'s
/// largest magnitude.
fn relative_diff(stream: &Arc<CudaStream>, out: &CudaSlice<f16>, want: &[f32]) -> Result<f64> {
    let got = stream.clone_dtoh(out)?;
    let diff = got.iter().zip(want).map(|(g, w)| (g.to_f32() - w).abs()).fold(0f32, f32::max);
    Ok(diff as f64 / want.iter().map(|w| w.abs()).fold(f32::MIN_POSITIVE, f32::max) as f64)
}

/// PyTorch's seconds for (rows, n, k), from the script's JSON.
fn torch_secs(torch: &Value, shape: (usize, usize, usize)) -> Option<f64> {
    torch["rows"].as_array()?.iter().find_map(|r| {
        let same =
            [("rows", shape.0), ("n", shape.1), ("k", shape.2)].iter().all(|(f, v)| r[*f].as_u64() == Some(*v as u64));
        same.then(|| r["seconds"].as_f64())?
    })
}

pub fn run(a: Args) -> Result<()> {
    let dev = VDevice::Cuda(0).open(&CudaOptions::default())?;
    let Device::Cuda(cuda) = &dev else { unreachable!("a CUDA device opens as candle's CUDA device") };
    let rt = CudaRuntime::new(&dev)?;
    let stream = cuda.cuda_stream();
    let workspace = stream.alloc_zeros::<u8>(WORKSPACE)?;
    let lt = CudaBlasLT::new(stream.clone())?;
    let torch: Value = match &a.torch {
        Some(p) => serde_json::from_str(&std::fs::read_to_string(p).with_context(|| p.display().to_string())?)?,
        None => Value::Null,
    };
    println!(
        "{}; f16 products h[rows, k] · w[n, k]ᵀ, f32 accumulation; TFLOP/s (best of 5 × {} queued)",
        rt.gpu().name(),
        a.reps
    );
    let variants = ["candle", "candle+ws", "gemmex", "gemmex+ws", "lt"];
    print!("{:>8} {:>8} {:>6} {:>6} |", "shape", "rows", "n", "k");
    for v in variants {
        print!(" {v:>10}");
    }
    println!(" {:>10} | {:>9} {:>9}", "torch", "best/torch", "lt diff");
    let mut out_rows = Vec::new();
    for &rows in &a.rows {
        for (name, n, k) in SHAPES {
            let shape = (rows, n, k);
            let h = Tensor::randn(0f32, 1.0, (rows, k), &dev)?.to_dtype(DType::F16)?;
            let w = (Tensor::randn(0f32, 1.0, (n, k), &dev)? / (k as f64).sqrt())?.to_dtype(DType::F16)?;
            let reference = h.matmul(&w.t()?)?;
            let raw =
                |t: &Tensor| -> Result<CudaSlice<f16>> { Ok(stream.clone_htod(&t.flatten_all()?.to_vec1::<f16>()?)?) };
            let (hs, ws) = (raw(&h)?, raw(&w)?);
            let want = reference.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            let mut out = stream.alloc_zeros::<f16>(rows * n)?;
            let flops = 2.0 * (rows * n * k) as f64;
            let mut secs = Vec::new();
            for ws_on in [None, Some(&workspace)] {
                set_workspace(cuda, ws_on)?;
                secs.push(per_call(&stream, a.reps, || Ok(h.matmul(&w.t()?).map(drop)?))?);
            }
            let mut diffs = Vec::new();
            for ws_on in [None, Some(&workspace)] {
                set_workspace(cuda, ws_on)?;
                secs.push(per_call(&stream, a.reps, || gemm_ex(cuda, &hs, &ws, &mut out, shape))?);
                diffs.push(relative_diff(&stream, &out, &want)?);
            }
            set_workspace(cuda, None)?;
            secs.push(per_call(&stream, a.reps, || gemm_lt(&lt, &hs, &ws, &mut out, shape))?);
            diffs.push(relative_diff(&stream, &out, &want)?);
            // f16 outputs of one f32-accumulated product: the order of the sums may differ, the
            // rounding to f16 (2⁻¹¹ relative) bounds what that changes, plus the accumulation's own.
            anyhow::ensure!(
                diffs.iter().all(|d| *d < 4e-3),
                "{name} rows {rows}: a product differs from candle's ({diffs:?})"
            );
            let t = torch_secs(&torch, shape);
            print!("{name:>8} {rows:>8} {n:>6} {k:>6} |");
            for s in &secs {
                print!(" {:>10.0}", flops / s / 1e12);
            }
            let best = secs.iter().copied().fold(f64::INFINITY, f64::min);
            println!(
                " {:>10} | {:>9} {:>9.1e}",
                t.map_or("n/a".into(), |t| format!("{:.0}", flops / t / 1e12)),
                t.map_or("n/a".into(), |t| format!("{:.2}×", t / best)),
                diffs[2]
            );
            let named: serde_json::Map<String, Value> =
                variants.iter().zip(&secs).map(|(v, s)| (v.to_string(), json!(s))).collect();
            out_rows.push(json!({"shape": name, "rows": rows, "n": n, "k": k, "seconds": named, "torch_seconds": t, "max_relative_diff": diffs}));
        }
    }
    stream.synchronize()?;
    drop(workspace);
    // The probe `bench serve` times for the 8B: 4,096 rows through its FFN's up product.
    let probe = Rates::measure(&dev, (4096, 4096, 14336), 1 << 30)?;
    // The probe as it was before it took the model's layout: the weight stored [inner, cols].
    let (x, up) = (Tensor::randn(0f32, 1.0, (4096, 4096), &dev)?, Tensor::randn(0f32, 1.0, (4096, 14336), &dev)?);
    let (x, up) = (x.to_dtype(DType::F16)?, up.to_dtype(DType::F16)?);
    let untransposed =
        2.0 * 4096.0 * 4096.0 * 14336.0 / super::roofline::best_seconds(&dev, || x.matmul(&up).map(drop))?;
    println!(
        "bench serve's physical estimate (Rates::measure) on the 8B: {:.0} TFLOP/s f16 matmul, [4096×4096]·[14336×4096]ᵀ; {:.0} with the weight stored [4096×14336] (the probe before this layout)",
        probe.matmul_flops / 1e12,
        untransposed / 1e12
    );
    println!("candle: h.matmul(wᵀ) (cublasGemmStridedBatchedEx, one batch, output allocated per call); +ws: veloq's 32 MiB cuBLAS workspace on candle's handle; gemmex: cublasGemmEx on the same handle into one output buffer; lt: cuBLASLt, heuristic's first algorithm, 32 MiB workspace; torch: torch.matmul on the same shapes in the same call; best/torch > 1 means the fastest variant here beats PyTorch");
    write_json(
        &a.json,
        &json!({"device": rt.gpu().name(), "reps": a.reps, "rows": out_rows, "torch": torch, "estimate_probe_flops": probe.matmul_flops, "untransposed_probe_flops": untransposed}),
    )
}
