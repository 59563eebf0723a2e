//! Fused vs naive nearest-centroid search on the shapes, in one run: time, peak extra heap,
//! ratio, sub-vectors per second and the share of this CPU's FMA peak.

use anyhow::{bail, Result};
use clap::Args as ClapArgs;
use serde_json::json;
use std::path::PathBuf;

use veloq::calibrate::{kmeans, KMeansConfig};
use veloq::codec::codebook::{Codebook, CodebookSet, Granularity, PqShape};
use veloq::codec::pack::packed_len;
use veloq::codec::search::reference::search_rows_naive;
use veloq::codec::search::search_rows;
use veloq::codec::search::Metric;
use veloq_lab::measure::peak_extra;

use super::{median_secs, write_json};

#[derive(ClapArgs)]
pub struct Args {
    /// Shapes as S,D,H,sub_dim; default: the six of the core issue.
    #[arg(long = "shape", value_parser = parse_shape)]
    shapes: Vec<(usize, usize, usize, usize)>,
    /// Codebook bits (256 centroids = 8).
    #[arg(long, default_value_t = 8)]
    bits: u32,
    /// Timed repetitions of the fused kernel (median reported).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Skip the naive path for shapes whose difference tensor exceeds this many GiB.
    #[arg(long, default_value_t = 10.0)]
    naive_max_gib: f64,
    #[arg(long)]
    json: Option<PathBuf>,
}

fn parse_shape(s: &str) -> Result<(usize, usize, usize, usize), String> {
    let v: Vec<usize> =
        s.split(',').map(|x| x.trim().parse().map_err(|e| format!("{s}: {e}"))).collect::<Result<_, _>>()?;
    match v[..] {
        [a, b, c, d] => Ok((a, b, c, d)),
        _ => Err(format!("{s}: want S,D,H,sub_dim")),
    }
}

const DEFAULT_SHAPES: [(usize, usize, usize, usize); 6] =
    [(128, 128, 8, 8), (512, 128, 8, 8), (2048, 128, 8, 8), (8192, 128, 8, 8), (1024, 256, 4, 4), (4096, 256, 4, 4)];

/// This machine's f32 FMA peak: cores × 2 FMA units × 8 lanes × 2 flops × clock.
fn cpu_peak_gflops() -> (f64, usize, f64) {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let mhz = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("cpu MHz")).and_then(|l| l.split(':').nth(1)?.trim().parse::<f64>().ok())
        })
        .unwrap_or(3000.0);
    (cores as f64 * 32.0 * mhz / 1000.0, cores, mhz)
}

pub fn run(a: Args) -> Result<()> {
    let shapes = if a.shapes.is_empty() { DEFAULT_SHAPES.to_vec() } else { a.shapes.clone() };
    let (peak, cores, mhz) = cpu_peak_gflops();
    println!(
        "nearest-centroid search, {} centroids, f32 input; CPU: {cores} threads at {mhz:.0} MHz, FMA peak {peak:.0} GFLOP/s",
        1 << a.bits
    );
    println!(
        "{:>6} {:>4} {:>2} {:>2} {:>9} | {:>10} {:>10} | {:>9} {:>9} {:>9} {:>9} | {:>7} {:>7} | {:>8} {:>6}",
        "S",
        "D",
        "H",
        "sd",
        "N",
        "naive ms",
        "naive MiB",
        "exact ms",
        "expand ms",
        "out KiB",
        "extra KiB",
        "×exact",
        "×expand",
        "Msub/s",
        "%peak"
    );
    let mut rows = Vec::new();
    let mut rng_state = 0x9E3779B97F4A7C15u64;
    let mut rand = move || {
        // xorshift: fresh, non-zero data without pulling in a dependency for a benchmark
        rng_state ^= rng_state << 13;
        rng_state ^= rng_state >> 7;
        rng_state ^= rng_state << 17;
        (rng_state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    };
    for (s, d, h, sd) in shapes {
        let shape = PqShape::new(sd, a.bits)?;
        let book = Codebook::new(sd, (0..shape.centroids() * sd).map(|_| rand()).collect())?;
        let books = CodebookSet::new(shape, Granularity::PerLayer, d / sd, vec![book])?;
        let x: Vec<f32> = (0..s * h * d).map(|_| rand()).collect();
        let n = s * h * d / sd;
        let out_bytes = packed_len(n, a.bits);
        let mut out = vec![0u8; out_bytes];
        // Warm up (thread pool, page faults of `out`).
        search_rows(&x, d, &books, Metric::Expanded, &mut out)?;
        let mut extra = 0usize;
        let mut fused = |metric| -> Result<f64> {
            let mut err = Ok(());
            let t = median_secs(a.reps, || {
                let (r, e) = peak_extra(|| search_rows(&x, d, &books, metric, &mut out));
                extra = extra.max(e);
                err = err.clone().and(r.map_err(|e| e.to_string()));
            });
            if let Err(e) = err {
                bail!(e)
            }
            Ok(t)
        };
        let t_exact = fused(Metric::Exact)?;
        let t_exp = fused(Metric::Expanded)?;
        // Peak extra includes the output when the kernel allocates it; here the caller owns it,
        // so the bound to check is extra ≤ 1 MiB on top of the (preallocated) output.
        let diff_gib = (n * shape.centroids() * sd * 4) as f64 / (1u64 << 30) as f64;
        let (t_naive, naive_peak) = if diff_gib <= a.naive_max_gib {
            let ((codes, t), peak) = peak_extra(|| {
                let st = std::time::Instant::now();
                let c = search_rows_naive(&x, d, &books);
                (c, st.elapsed().as_secs_f64())
            });
            // The fused exact path must agree with the reference bit for bit.
            let mut fused_codes = vec![0u16; n];
            search_rows(&x, d, &books, Metric::Exact, &mut out)?;
            veloq::codec::pack::unpack(&out, a.bits, &mut fused_codes)?;
            if fused_codes != codes {
                bail!("fused exact search disagrees with the reference at S={s}");
            }
            (Some(t), Some(peak))
        } else {
            (None, None)
        };
        let best = t_exact.min(t_exp);
        let rate = n as f64 / best;
        let flops = n as f64
            * shape.centroids() as f64
            * if t_exp <= t_exact { Metric::Expanded } else { Metric::Exact }.flops_per_pair(sd) as f64;
        let gflops = flops / best / 1e9;
        let fmt = |v: Option<f64>, k: f64| v.map_or("-".to_string(), |v| format!("{:.1}", v * k));
        println!(
            "{s:>6} {d:>4} {h:>2} {sd:>2} {n:>9} | {:>10} {:>10} | {:>9.2} {:>9.2} {:>9.1} {:>9.1} | {:>7} {:>7} | {:>8.1} {:>5.0}%",
            fmt(t_naive, 1e3),
            fmt(naive_peak.map(|p| p as f64), 1.0 / (1 << 20) as f64),
            t_exact * 1e3,
            t_exp * 1e3,
            out_bytes as f64 / 1024.0,
            extra as f64 / 1024.0,
            fmt(t_naive.map(|t| t / t_exact), 1.0),
            fmt(t_naive.map(|t| t / t_exp), 1.0),
            rate / 1e6,
            100.0 * gflops / peak
        );
        rows.push(json!({
            "S": s, "D": d, "H": h, "sub_dim": sd, "centroids": shape.centroids(), "subvectors": n,
            "naive_s": t_naive, "naive_peak_bytes": naive_peak,
            "fused_exact_s": t_exact, "fused_expanded_s": t_exp,
            "fused_output_bytes": out_bytes, "fused_peak_extra_bytes": extra,
            "speedup_exact": t_naive.map(|t| t / t_exact), "speedup_expanded": t_naive.map(|t| t / t_exp),
            "subvectors_per_s": rate, "gflops": gflops, "cpu_peak_gflops": peak,
        }));
    }
    println!("extra = peak heap growth during the fused call beyond the caller-owned output (bound: 1 MiB)");

    // Calibration cost: k-means on 1M sub-vectors of 8 with 256 centroids, default settings.
    let points: Vec<f32> = (0..(1usize << 20) * 8).map(|_| rand()).collect();
    let start = std::time::Instant::now();
    let (_, rep) = kmeans(&points, 8, &KMeansConfig::new(256, 0), &|_, _| {})?;
    let t_km = start.elapsed().as_secs_f64();
    println!(
        "k-means 256×8 on {} sub-vectors: {t_km:.2} s, {} Lloyd iterations, converged: {}, final MSE {:.5}",
        rep.points,
        rep.iterations,
        rep.converged,
        rep.final_mse()
    );
    let km = json!({ "points": rep.points, "seconds": t_km, "iterations": rep.iterations, "converged": rep.converged, "mse": rep.mse });
    write_json(
        &a.json,
        &json!({ "bench": "search", "bits": a.bits, "cpu_threads": cores, "cpu_mhz": mhz, "rows": rows, "kmeans": km }),
    )
}
