//! The CUDA kernels against the CPU path (`veloq_lab::cuda_checks`), as tests: quantize (single
//! codecs and key/value pairs in one launch), the f32/f16/bf16 conversions, the row kernels of
//! prompt chunks, the f16 GEMV in every fused form, decode attention
//! over codes for every kernel variant. Built with `--features cuda`; a machine without a GPU
//! fails them unless `VELOQ_SKIP_CUDA_TESTS=1` says to skip (CI has no GPU and builds without the
//! feature; `scripts/device/smoke.sh` runs them on the H200).
#![cfg(feature = "cuda")]

use veloq::kernels::cuda::Gpu;
use veloq::kernels::KernelOptions;
use veloq_lab::cuda_checks;
use veloq_lab::synthetic::Rng;

/// GPU 0, or `None` when the run says to skip; a missing GPU otherwise fails the test.
fn gpu() -> Option<Gpu> {
    match Gpu::new(0, KernelOptions::default()) {
        Ok(g) => Some(g),
        Err(e) if std::env::var("VELOQ_SKIP_CUDA_TESTS").is_ok_and(|v| v == "1") => {
            eprintln!("skipped (VELOQ_SKIP_CUDA_TESTS=1): {e}");
            None
        }
        Err(e) => panic!("no CUDA device ({e}); set VELOQ_SKIP_CUDA_TESTS=1 to skip the CUDA tests"),
    }
}

fn rng() -> Rng {
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1;
    eprintln!("seed {seed}");
    Rng(seed)
}

#[test]
fn cuda_quantize_gives_the_cpu_encoders_codes() {
    let Some(gpu) = gpu() else { return };
    let mut rng = rng();
    for &shape in &cuda_checks::QUANTIZE_CHECKS {
        cuda_checks::check_quantize(&gpu, &mut rng, shape, false).unwrap();
    }
    for &shape in &cuda_checks::QUANTIZE_PAIR_CHECKS {
        cuda_checks::check_quantize(&gpu, &mut rng, shape, true).unwrap();
    }
}

#[test]
fn cuda_conversions_round_as_the_host_does() {
    let Some(gpu) = gpu() else { return };
    let checked = cuda_checks::check_convert(&gpu, &mut rng()).unwrap();
    assert!(checked > 6_000_000, "{checked} conversions checked");
}

#[test]
fn cuda_row_kernels_match_the_f64_reference() {
    let Some(gpu) = gpu() else { return };
    let checked = cuda_checks::check_rows(&gpu, &mut rng()).unwrap();
    assert!(checked > 30_000_000, "{checked} row-kernel elements checked");
}

#[test]
fn cuda_gemv_matches_the_f64_reference_in_every_form() {
    let Some(gpu) = gpu() else { return };
    let checks = cuda_checks::check_gemv(&gpu, &mut rng()).unwrap();
    assert!(checks.len() > 100, "{} GEMV checks ran", checks.len());
}

#[test]
fn cuda_attention_over_codes_matches_the_f64_reference() {
    let Some(gpu) = gpu() else { return };
    let checks = cuda_checks::attention_shapes(&gpu, &mut rng(), &cuda_checks::default_variants()).unwrap();
    assert!(checks.len() >= 3 * cuda_checks::ATTENTION_CHECKS.len(), "{} attention checks ran", checks.len());
}

#[test]
fn cuda_ragged_decode_matches_one_call_per_sequence() {
    let Some(gpu) = gpu() else { return };
    let checks = cuda_checks::ragged_batches(&gpu, &mut rng(), &cuda_checks::default_variants()).unwrap();
    // Three variants on the three tensor-core geometries, tables alone on the last; with and without codes.
    assert_eq!(checks.len(), 2 * (3 * 3 + 1), "ragged checks ran");
}
