//! Experiment (issue 34): do keys lose less at 2 bits when the codec codes them minus their
//! pre-RoPE mean, rotated to each position? A key head's channels carry large constant means
//! before RoPE (KVQuant's outlier channels); after RoPE a pair's mean turns with the position, so
//! the codec's per-channel centering (post-RoPE) cannot remove it and the codebook spends its
//! centroids on it. With μ the pre-RoPE mean per (kv head, channel) and R(p) RoPE at position
//! p, the codec codes k − R(p)μ and attention adds q·R(p)μ exactly (a complex multiply-add a
//! position per pair kept: `--pairs`). Against the default key codec (centered, smoothed,
//! Hadamard), trained on 4,096 tokens of *Persuasion* and scored on 2,048 of *Emma* (every 32nd
//! query from 256 on, sink 4 and window 16 exact), per layer: the share of the keys' spread
//! around their post-RoPE mean that the turning mean holds; the rows that code closer shifted;
//! then for the default, the shifted code, the better of two default codecs per row (the flag
//! bit's fair anchor) and the better of the default and the shifted code per row — the score
//! RMS error, its spread under the exact attention (what softmax sees) and the attention's total
//! variation.
//!
//! `cargo run --release -p veloq-lab --example rope_center -- --bits 2 --pairs 32`
use std::path::PathBuf;

use clap::Parser;

use veloq::calibrate::{train_codec, KMeansConfig};
use veloq::codec::codebook::PqShape;
use veloq::codec::vecinfer::CodecSpec;
use veloq_lab::held_out::{score_keys, smollm2_activations};
use veloq_lab::simulate::round_trip;
use veloq_lab::turning::{closer_per_row, pre_rope_mean, shifted, Rope};

#[derive(Parser)]
struct Args {
    /// Bits per element of the key codes: 2 (256 centroids of 4) or 4 (256 of 2).
    #[arg(long, default_value_t = 2.0)]
    bits: f64,
    /// RoPE pairs per kv head whose turning mean is removed (those of the largest mean norm).
    #[arg(long, default_value_t = 32)]
    pairs: usize,
    /// The data cache of scripts/fetch-data.
    #[arg(long)]
    cache: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let (model, a, b) = smollm2_activations(args.cache)?;
    let (nh, nkv, d) = (model.info.n_heads, model.info.identity.n_kv_heads, model.info.identity.head_dim);
    let sub = if args.bits >= 4.0 { 2 } else { 4 };
    let spec = CodecSpec::keys(PqShape::new(sub, 8)?);
    let row = nkv * d;
    println!(
        "bits {} pairs {}: layer | turning share, rows that pick the shift | sigma, spread, tv: base shifted pick(base,base') pick(base,shifted)",
        args.bits, args.pairs
    );
    let mut total = [[0.0f64; 3]; 4];
    for l in 0..a.layers.len() {
        let (ca, cb) = (&a.layers[l], &b.layers[l]);
        let tokens = ca.keys.len() / row;
        // Pre-RoPE keys of the calibration (its passes restart at position 0 every 2,048 tokens).
        let rope = Rope::of(&model, l)?;
        let mut pre = ca.keys.clone();
        rope.turn_rows(&mut pre, nkv, |t| t % 2048, true);
        let mean = |rows: &[f32]| -> Vec<f64> {
            let mut m = vec![0.0f64; row];
            rows.chunks_exact(row).for_each(|r| m.iter_mut().zip(r).for_each(|(m, &x)| *m += x as f64 / tokens as f64));
            m
        };
        let spread = |rows: &[f32], m: &[f64]| -> f64 {
            rows.chunks_exact(row).map(|r| r.iter().zip(m).map(|(&x, &u)| (x as f64 - u).powi(2)).sum::<f64>()).sum()
        };
        let mut mu = pre_rope_mean(&ca.keys, nkv, 2048, &rope);
        let pre_mu: Vec<f64> = mu.iter().map(|&m| m as f64).collect();
        let share = 1.0 - spread(&pre, &pre_mu) / spread(&ca.keys, &mean(&ca.keys));
        rope.keep_largest_pairs(&mut mu, args.pairs);
        let cfg = KMeansConfig::new(256, 7 + l as u64);
        let (base, _) = train_codec(&ca.keys, nkv, d, &spec, &cfg)?;
        let kb = round_trip(&base, &cb.keys)?;
        let (centered, _) = train_codec(&shifted(&ca.keys, &mu, nkv, &rope, |t| t % 2048), nkv, d, &spec, &cfg)?;
        let neg: Vec<f32> = mu.iter().map(|m| -m).collect();
        let km = shifted(&round_trip(&centered, &shifted(&cb.keys, &mu, nkv, &rope, |t| t))?, &neg, nkv, &rope, |t| t);
        // Per (token, kv head) the better of two codes (one flag bit a row): the shifted code
        // against the default's, and, as the fair anchor for that bit, two default codecs.
        let (base2, _) = train_codec(&ca.keys, nkv, d, &spec, &KMeansConfig::new(256, 1007 + l as u64))?;
        let kb2 = round_trip(&base2, &cb.keys)?;
        let (pick_base, _) = closer_per_row(&cb.keys, &kb, &kb2, d);
        let (pick_shift, took) = closer_per_row(&cb.keys, &kb, &km, d);
        let took = took as f64 / (cb.keys.len() / d) as f64;
        let variants = [kb.as_slice(), &km, &pick_base, &pick_shift];
        let scores = score_keys(cb, nh, nkv, d, &variants);
        let cols: Vec<[f64; 3]> = scores.iter().map(|s| [s.sigma, s.spread, s.tv]).collect();
        let col = |k: usize| cols.iter().map(|c| format!("{:.3}", c[k])).collect::<Vec<_>>().join(" ");
        println!("{l:2} | {share:.3} {took:.2} | {} | {} | {}", col(0), col(1), col(2));
        for (t, c) in total.iter_mut().zip(&cols) {
            t.iter_mut().zip(c).for_each(|(t, c)| *t += c);
        }
    }
    let nl = a.layers.len() as f64;
    let col = |k: usize| total.iter().map(|c| format!("{:.3}", c[k] / nl)).collect::<Vec<_>>().join(" ");
    println!("mean | | {} | {} | {}", col(0), col(1), col(2));
    Ok(())
}
