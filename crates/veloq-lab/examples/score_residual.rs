//! Experiment (issue 34): a second stage for 2-bit keys that removes the score error attention
//! sees. Product VQ leaves a residual e = k − k̂ whose score error q·e is what dilutes the needle.
//! The queries' second moment C = E[qqᵀ] is close to low rank, so a few numbers per position can
//! carry most of q·e: with y = C^½ e, E_q[(q·e)²] = ‖y‖², and the best rank-r correction keeps
//! c = U_rᵀ y (U_r: the top eigenvectors of E[yyᵀ] = C^½ E[eeᵀ] C^½), adding (U_rᵀ C^{-½} q)·c to
//! the coded score ([`veloq_lab::second_stage`]). c is stored as b-bit uniform codes with a
//! calibrated step per (kv head, component), or exactly (`f32`) to see the ceiling.
//!
//! Trained on 4,096 tokens of *Persuasion*, scored on 2,048 of *Emma* (every 32nd query from 256
//! on; the first 4 and the last 16 positions exact, as in the cache): per configuration the mean
//! over layers of the score RMS error and of the attention's total variation, against the plain
//! 2- and 4-bit key codecs.
//!
//! `cargo run --release -p veloq-lab --example score_residual`
use std::path::PathBuf;

use clap::Parser;

use veloq::calibrate::{train_codec, KMeansConfig};
use veloq::codec::codebook::PqShape;
use veloq::codec::vecinfer::CodecSpec;
use veloq_candle::cache::Heads;
use veloq_lab::held_out::{score_keys, smollm2_activations};
use veloq_lab::second_stage::ScoreResidual;
use veloq_lab::simulate::round_trip;

#[derive(Parser)]
struct Args {
    /// Ranks of the stage, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "2,4,8,16")]
    ranks: Vec<usize>,
    /// Bits per coefficient (0: exact f32), comma separated.
    #[arg(long, value_delimiter = ',', default_value = "0,8,4,3")]
    bits: Vec<u32>,
    /// The data cache of scripts/fetch-data.
    #[arg(long)]
    cache: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let (model, a, b) = smollm2_activations(args.cache)?;
    let (nh, nkv, d) = (model.info.n_heads, model.info.identity.n_kv_heads, model.info.identity.head_dim);
    // (name, key bits per element, rank, coefficient bits); rank 0: the first stage alone.
    let mut configs: Vec<(String, f64, usize, u32)> = vec![("2-bit".into(), 2.0, 0, 0)];
    for &r in &args.ranks {
        for &bits in &args.bits {
            let per = if bits == 0 { 32 } else { bits } as f64 * r as f64 / d as f64;
            let name = format!("2-bit+r{r}{}", if bits == 0 { "f32".into() } else { format!("b{bits}") });
            configs.push((name, 2.0 + per, r, bits));
        }
    }
    configs.push(("4-bit".into(), 4.0, 0, 0));
    let mut sums = vec![(0.0f64, 0.0f64); configs.len()];
    let nl = a.layers.len();
    for l in 0..nl {
        let (ca, cb) = (&a.layers[l], &b.layers[l]);
        let spec = |sub| CodecSpec::keys(PqShape::new(sub, 8).expect("a shape"));
        let (two, _) = train_codec(&ca.keys, nkv, d, &spec(4), &KMeansConfig::new(256, 7 + l as u64))?;
        let (four, _) = train_codec(&ca.keys, nkv, d, &spec(2), &KMeansConfig::new(256, 7 + l as u64))?;
        let (ka2, kb2) = (round_trip(&two, &ca.keys)?, round_trip(&two, &cb.keys)?);
        let keysets: Vec<Vec<f32>> = configs
            .iter()
            .map(|(name, _, r, bits)| match (name.as_str(), r) {
                ("4-bit", _) => Ok(round_trip(&four, &cb.keys)?),
                (_, 0) => Ok(kb2.clone()),
                _ => {
                    let stage =
                        ScoreResidual::train(&ca.keys, &ka2, &ca.queries, Heads { q: nh, kv: nkv, dim: d }, *r, *bits)
                            .map_err(anyhow::Error::msg)?;
                    let mut k = kb2.clone();
                    stage.correct(&cb.keys, &mut k);
                    Ok(k)
                }
            })
            .collect::<anyhow::Result<_>>()?;
        // Score error and attention total variation on held-out queries.
        let variants: Vec<&[f32]> = keysets.iter().map(Vec::as_slice).collect();
        for (sum, s) in sums.iter_mut().zip(score_keys(cb, nh, nkv, d, &variants)) {
            sum.0 += s.sigma;
            sum.1 += s.tv;
        }
        eprintln!("layer {l} done");
    }
    println!("{:<16} {:>10} {:>8} {:>8}", "keys", "bits/elem", "sigma", "tv");
    for (c, cfg) in configs.iter().enumerate() {
        println!("{:<16} {:>10.3} {:>8.3} {:>8.3}", cfg.0, cfg.1, sums[c].0 / nl as f64, sums[c].1 / nl as f64);
    }
    Ok(())
}
