//! Issue 34's simulated candidates as flags, one set for `eval` and `eval needle`: each command
//! scores or answers with what they build beside its methods.

use anyhow::Result;
use clap::Args as ClapArgs;

use veloq::artifact::Calibration;
use veloq_candle::model::Model;
use veloq_candle::Method;
use veloq_lab::book_cache::BookCache;
use veloq_lab::calibrations::{
    key_head_candidates, recorded_candidates, rescore_candidates, rescore_name, rescore_says, simulations, Candidate,
    KeyHeads, RecordedCandidates,
};
use veloq_lab::rescore::Reread;
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
    /// Issue 34's candidate: also run every VecInfer method simulated as two residual stages of
    /// its codes over twice the channels (the same bits: `vq-2`'s 8-bit codes of 4 channels
    /// become two 8-bit codes of 8, the second coding what the first leaves).
    #[arg(long)]
    pub residual: bool,
    /// Issue 34's candidate: also run every VecInfer method simulated with value books trained on
    /// rows drawn by the attention they receive while coded on the calibration text, a fraction of
    /// the rows by that mass and the rest uniformly, once per fraction, comma separated (`0.5,1`).
    #[arg(long, value_delimiter = ',')]
    pub value_mass: Vec<f64>,
    /// Issue 34's candidate: also run every VecInfer method simulated with its keys coded around
    /// their pre-RoPE mean turned to each position (KVQuant's pre-RoPE keys, read as a
    /// per-position center), or as they are where that codes a row better (one flag bit a row),
    /// once per count of RoPE pairs whose mean is kept per kv head (the largest; attention adds a
    /// complex multiply-add a position for each), comma separated (`32,8`; head_dim / 2 = all).
    #[arg(long, value_delimiter = ',')]
    pub turning_keys: Vec<usize>,
    /// Issue 34's candidate: also run every VecInfer method simulated with attention that reads
    /// the exact key and value of the N best-scoring coded positions per query head (a second
    /// precision read only there), once per N, comma separated (`16,64`); with `--value-mass`,
    /// each of those candidates with it too.
    #[arg(long, value_delimiter = ',')]
    pub rescore: Vec<usize>,
    /// As `--rescore`, reading only the exact keys of the N positions (their values stay coded:
    /// the copy a cache would keep is half as large), once per N, comma separated.
    #[arg(long, value_delimiter = ',')]
    pub rescore_keys: Vec<usize>,
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
    /// The rescoring candidates asked for: `--rescore`'s, then `--rescore-keys`'.
    pub fn rereads(&self) -> Vec<Reread> {
        let rows = self.rescore.iter().map(|&top| Reread::rows(top));
        rows.chain(self.rescore_keys.iter().map(|&top| Reread::keys(top))).collect()
    }

    /// Checks the rescoring attention on `device` when a rescoring candidate is asked for there:
    /// it runs in the device's tensor operations and the tests check it on the CPU only, so a run
    /// on a GPU checks it before spending its time on it.
    pub fn check_on(&self, device: &candle_core::Device, seed: u64) -> Result<()> {
        if !self.rereads().is_empty() && !device.is_cpu() {
            let worst = veloq_lab::rescore::check(device, seed)?;
            eprintln!("rescoring attention on {device:?}: within {worst:.1e} of the f64 reference");
        }
        Ok(())
    }

    /// The candidates asked for, for every calibrated VecInfer method in `chosen` (`model` records
    /// the calibration text `calib` in `window`-position passes where a candidate trains on it;
    /// `seed` is the calibrations' k-means seed; `books` keeps trained books between runs).
    #[allow(clippy::too_many_arguments)]
    pub fn build(
        &self,
        model: &Model,
        calib: &[u32],
        window: usize,
        chosen: &[Method],
        cals: &[Option<Calibration>],
        seed: u64,
        books: Option<BookCache>,
    ) -> Result<Vec<Candidate>> {
        let mut out = simulations(model, calib, window, chosen, cals, &self.second_stage, self.apart)?;
        let recorded = RecordedCandidates {
            outlier_rows: self.outlier_rows.clone(),
            per_head: self.per_head,
            residual: self.residual,
            value_mass: self.value_mass.clone(),
            turning_keys: self.turning_keys.clone(),
            seed,
            books,
        };
        let recorded = recorded_candidates(model, calib, window, chosen, cals, &recorded)?;
        // The best together: value books by mass read with the rescoring too.
        let together = recorded.iter().filter(|c| c.label.contains("/value-mass")).flat_map(|c| {
            self.rescore.iter().map(move |&top| {
                let reread = Reread::rows(top);
                let mut simulation = c.simulation.clone();
                simulation.set_rescore(reread);
                Candidate {
                    label: format!("{}{}", c.label, rescore_name(reread)),
                    description: format!("{}; {}", c.description, rescore_says(reread)),
                    simulation,
                }
            })
        });
        let together: Vec<Candidate> = together.collect();
        out.extend(recorded);
        out.extend(rescore_candidates(chosen, cals, &self.rereads(), model.info.identity.head_dim)?);
        out.extend(together);
        let key_heads = KeyHeads { fractions: self.key_heads.clone(), random: self.key_heads_random, seed };
        out.extend(key_head_candidates(model, calib, window, chosen, cals, &key_heads)?);
        Ok(out)
    }
}
