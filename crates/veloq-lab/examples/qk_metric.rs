//! Experiment (issue 34): does coding keys in the metric of the queries' second moment lower the
//! score error q·(k − k̂) that attention sees? With W = (E[qqᵀ] + ridge)^½ per kv head (pooled
//! over its query group), ‖W(k − k̂)‖² = E_q[(q·(k − k̂))²], so k-means on W(k − μ) minimises the
//! expected score error instead of the key's Euclidean error; queries go through W⁻¹, kernels
//! unchanged. Two bases: `hadamard` (W, then the usual rotation, one codebook per layer) and
//! `klt` (W, then the eigenbasis of the whitened keys in energy order, a codebook per sub-space).
//! Both against the default key codec (centered, √max|k| smoothing, Hadamard), trained on 4,096
//! tokens of *Persuasion* and scored on 2,048 of *Emma* (every 32nd query from 256 on, sink 4
//! and window 16 exact): per layer the score RMS error and the attention's total variation.
//!
//! `cargo run --release -p veloq-lab --example qk_metric -- --bits 2 --basis klt`
use std::path::PathBuf;

use clap::{Parser, ValueEnum};

use veloq::calibrate::{train_codec, KMeansConfig};
use veloq::codec::codebook::{Granularity, PqShape};
use veloq::codec::vecinfer::CodecSpec;
use veloq_lab::held_out::{score_keys, smollm2_activations};
use veloq_lab::linalg::{jacobi, matvec, spectral};
use veloq_lab::simulate::round_trip;

#[derive(Clone, Copy, PartialEq, ValueEnum)]
enum Basis {
    Hadamard,
    Klt,
}

#[derive(Parser)]
struct Args {
    /// Bits per element of the key codes: 2 (256 centroids of 4) or 4 (256 of 2).
    #[arg(long, default_value_t = 2.0)]
    bits: f64,
    /// Added to E[qqᵀ]'s diagonal, as a fraction of its mean eigenvalue.
    #[arg(long, default_value_t = 1e-3)]
    ridge: f64,
    #[arg(long, value_enum, default_value_t = Basis::Klt)]
    basis: Basis,
    /// The data cache of scripts/fetch-data.
    #[arg(long)]
    cache: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let (bits, ridge) = (args.bits, args.ridge);
    let (model, a, b) = smollm2_activations(args.cache)?;
    let (nh, nkv, d) = (model.info.n_heads, model.info.identity.n_kv_heads, model.info.identity.head_dim);
    let group = nh / nkv;
    let sub = if bits >= 4.0 { 2 } else { 4 };
    let shape = PqShape::new(sub, 8)?;
    let base_spec = CodecSpec::keys(shape);
    let klt = args.basis == Basis::Klt;
    let metric_spec = if klt {
        CodecSpec { shape, granularity: Granularity::PerSubspace, center: false, smooth: None, rotate: false }
    } else {
        CodecSpec { shape, granularity: Granularity::PerLayer, center: false, smooth: None, rotate: true }
    };
    println!("bits {bits} ridge {ridge}: layer | sigma base metric | tv base metric | eff.rank of C");
    let (mut sb, mut sm, mut tb, mut tm) = (0.0, 0.0, 0.0, 0.0);
    for l in 0..a.layers.len() {
        let (ca, cb) = (&a.layers[l], &b.layers[l]);
        let cfg = KMeansConfig::new(256, 7 + l as u64);
        let (base, _) = train_codec(&ca.keys, nkv, d, &base_spec, &cfg)?;
        let kb = round_trip(&base, &cb.keys)?;
        // Per kv head: mean of keys, second moment of its group's queries.
        let row = nkv * d;
        let mut mu = vec![0.0f64; row];
        let tokens = ca.keys.len() / row;
        ca.keys.chunks_exact(row).for_each(|r| mu.iter_mut().zip(r).for_each(|(m, &x)| *m += x as f64 / tokens as f64));
        let mu: Vec<f32> = mu.iter().map(|&m| m as f32).collect();
        let mut w = Vec::new();
        let mut winv = Vec::new();
        let mut ranks = Vec::new();
        for kv in 0..nkv {
            let mut c = vec![0.0f64; d * d];
            let mut count = 0.0;
            for t in 0..tokens {
                for h in kv * group..(kv + 1) * group {
                    let q = &ca.queries[(t * nh + h) * d..(t * nh + h + 1) * d];
                    for i in 0..d {
                        for j in 0..d {
                            c[i * d + j] += (q[i] * q[j]) as f64;
                        }
                    }
                    count += 1.0;
                }
            }
            c.iter_mut().for_each(|x| *x /= count);
            let tr: f64 = (0..d).map(|i| c[i * d + i]).sum();
            (0..d).for_each(|i| c[i * d + i] += ridge * tr / d as f64);
            let (vals, vecs) = jacobi(&c, d);
            let s2: f64 = vals.iter().map(|v| v * v).sum();
            ranks.push(tr * tr / s2);
            let wk = spectral(&vals, &vecs, d, f64::sqrt);
            let wi = spectral(&vals, &vecs, d, |x| 1.0 / x.sqrt());
            if !klt {
                w.push(wk);
                winv.push(wi);
                continue;
            }
            // Key covariance in the whitened space, and its eigenbasis sorted by energy.
            let mut m = vec![0.0f64; d * d];
            let mut y = vec![0.0f32; d];
            let mut cen = vec![0.0f32; d];
            for t in 0..tokens {
                let k = &ca.keys[(t * nkv + kv) * d..(t * nkv + kv + 1) * d];
                cen.iter_mut().zip(k).zip(&mu[kv * d..(kv + 1) * d]).for_each(|((c, &x), &u)| *c = x - u);
                matvec(&wk, &cen, &mut y);
                for i in 0..d {
                    for j in 0..d {
                        m[i * d + j] += (y[i] * y[j]) as f64 / tokens as f64;
                    }
                }
            }
            let (sv, u) = jacobi(&m, d);
            let mut order: Vec<usize> = (0..d).collect();
            order.sort_by(|&a, &b| sv[b].partial_cmp(&sv[a]).unwrap());
            let total: f64 = sv.iter().sum();
            let top = |k: usize| order[..k].iter().map(|&i| sv[i]).sum::<f64>() / total;
            if l % 6 == 0 {
                println!("  layer {l} kv {kv}: energy in top 4/8/16: {:.2} {:.2} {:.2}", top(4), top(8), top(16));
            }
            // T = Uᵀ W (rows in energy order), T⁻¹ = W⁻¹ U.
            let mut t = vec![0.0f32; d * d];
            let mut ti = vec![0.0f32; d * d];
            for (r, &e) in order.iter().enumerate() {
                for j in 0..d {
                    t[r * d + j] = (0..d).map(|i| u[i * d + e] * wk[i * d + j] as f64).sum::<f64>() as f32;
                    ti[j * d + r] = (0..d).map(|i| wi[j * d + i] as f64 * u[i * d + e]).sum::<f64>() as f32;
                }
            }
            w.push(t);
            winv.push(ti);
        }
        let whiten = |keys: &[f32]| -> Vec<f32> {
            let mut out = vec![0.0f32; keys.len()];
            let mut tmp = vec![0.0f32; d];
            for (r, (src, dst)) in keys.chunks_exact(d).zip(out.chunks_exact_mut(d)).enumerate() {
                let kv = r % nkv;
                tmp.iter_mut().zip(src).zip(&mu[kv * d..(kv + 1) * d]).for_each(|((t, &x), &m)| *t = x - m);
                matvec(&w[kv], &tmp, dst);
            }
            out
        };
        let (metric, _) = train_codec(&whiten(&ca.keys), nkv, d, &metric_spec, &cfg)?;
        let wb = whiten(&cb.keys);
        let xm = round_trip(&metric, &wb)?;
        let mut km = vec![0.0f32; xm.len()];
        for (r, (src, dst)) in xm.chunks_exact(d).zip(km.chunks_exact_mut(d)).enumerate() {
            let kv = r % nkv;
            matvec(&winv[kv], src, dst);
            dst.iter_mut().zip(&mu[kv * d..(kv + 1) * d]).for_each(|(o, &m)| *o += m);
        }
        // Score error and attention total variation on held-out queries.
        let scores = score_keys(cb, nh, nkv, d, &[&kb, &km]);
        let (s1, s2, t1, t2) = (scores[0].sigma, scores[1].sigma, scores[0].tv, scores[1].tv);
        println!(
            "{l:2} | {s1:.3} {s2:.3} | {t1:.3} {t2:.3} | {:?}",
            ranks.iter().map(|r| format!("{r:.1}")).collect::<Vec<_>>()
        );
        sb += s1;
        sm += s2;
        tb += t1;
        tm += t2;
    }
    let nl = a.layers.len() as f64;
    println!("mean | {:.3} {:.3} | {:.3} {:.3}", sb / nl, sm / nl, tb / nl, tm / nl);
    Ok(())
}
