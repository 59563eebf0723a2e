//! Issue 34's simulated candidates as flags, one set for `eval` and `eval needle`: each command
//! scores or answers with what they build beside its methods.

use anyhow::Result;
use clap::Args as ClapArgs;

use veloq::artifact::Calibration;
use veloq_candle::model::Model;
use veloq_candle::Method;
use veloq_lab::calibrations::{
    key_head_candidates, recorded_candidates, rescore_candidates, simulations, Candidate, KeyHeads, RecordedCandidates,
};
use veloq_lab::second_stage::StageSpec;

/// The candidate flags (each adds runs; none asked for, none built).
#[derive(ClapArgs, Clone, Debug)]
pub struct CandidateArgs {
    /// Issue 34's candidate: also run every VecInfer method simulated (its reconstructions in an
    /// fp16 cache) alone and with a second stage of each shape, comma separated: `r8b4` (keys: 8
    /// coefficients of 4 bits per position and kv head, carrying the score error the queries
    /// see), `v:r8b4` (values, weighed by the output projection), `kv:r8b4` (both).
    #[arg(long, value_delimiter = ',')]
    pub second_stage: Vec<StageSpec>,
    /// Also run every VecInfer method with only its keys coded and with only its values coded
    /// (the other side f16; simulated), to tell which side loses what.
    #[arg(long)]
    pub apart: bool,
    /// Issue 34's candidate: also run every VecInfer method simulated with the key and value
    /// rows it codes worst kept in f16 (a side table), once per fraction of the rows, comma
    /// separated (`0.01,0.03`); each layer and kv head's limit is set on the calibration text.
    #[arg(long, value_delimiter = ',')]
    pub outlier_rows: Vec<f64>,
    /// Issue 34's candidate: also run every VecInfer method simulated with a codebook per kv head
    /// (each trained on its head's keys or values alone) instead of one per layer.
    #[arg(long)]
    pub per_head: bool,
    /// Issue 34's candidate: also run every VecInfer method simulated with attention that reads
    /// the exact key and value of the N best-scoring coded positions per query head (a second
    /// precision read only there), once per N, comma separated (`16,64`).
    #[arg(long, value_delimiter = ',')]
    pub rescore: Vec<usize>,
    /// Issue 34's candidate: also run every VecInfer method but the one with the most key bits
    /// with that one's key codecs on a fraction of the (layer, kv head)s, those whose attention
    /// the low-precision keys distort most on the calibration text, once per fraction, comma
    /// separated (`0.25,0.5`); values stay the method's own.
    #[arg(long, value_delimiter = ',')]
    pub key_heads: Vec<f64>,
    /// With `--key-heads`: also the same number of heads drawn at random (the ranking's control).
    #[arg(long, requires = "key_heads")]
    pub key_heads_random: bool,
}

impl CandidateArgs {
    /// The candidates asked for, for every calibrated VecInfer method in `chosen` (`model` records
    /// the calibration text `calib` in `window`-position passes where a candidate trains on it;
    /// `seed` is the calibrations' k-means seed).
    pub fn build(
        &self,
        model: &Model,
        calib: &[u32],
        window: usize,
        chosen: &[Method],
        cals: &[Option<Calibration>],
        seed: u64,
    ) -> Result<Vec<Candidate>> {
        let mut out = simulations(model, calib, window, chosen, cals, &self.second_stage, self.apart)?;
        let recorded = RecordedCandidates { outlier_rows: self.outlier_rows.clone(), per_head: self.per_head, seed };
        out.extend(recorded_candidates(model, calib, window, chosen, cals, &recorded)?);
        out.extend(rescore_candidates(chosen, cals, &self.rescore, model.info.identity.head_dim)?);
        let key_heads = KeyHeads { fractions: self.key_heads.clone(), random: self.key_heads_random, seed };
        out.extend(key_head_candidates(model, calib, window, chosen, cals, &key_heads)?);
        Ok(out)
    }
}
