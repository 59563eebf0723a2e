//! Per-channel smoothing of keys: k' = k ⊘ s, with s per (kv-head, channel) from calibration data.
//!
//! A few key channels carry outliers many times larger than the rest (RoPE pairs with low
//! frequency); dividing by a per-channel scale before the rotation keeps them from dominating the
//! codebook. The query side absorbs s (q·k = (s ⊙ q)·k'), so attention never multiplies it back.
//!
//! Rules:
//! - [`SmoothRule::MaxAbs`]: s_c = max_t |k_tc| (the VecInfer paper's choice);
//! - [`SmoothRule::SqrtMaxAbs`]: s_c = √(max_t |k_tc|), a half-strength version that equalises
//!   channel ranges only partly (SmoothQuant's α = ½ with a unit weight side).
//!
//! Full max-normalisation squeezes the ordinary channels into a corner of the codebook's range;
//! √max keeps most of the benefit on the outlier channels (on SmolLM2 it beat both max and no
//! smoothing: results/README.md, the `vq-2/no-smooth` rows and "Which smoothing"). `SqrtMaxAbs` is therefore the default ([`CodecSpec::keys`](super::vecinfer::CodecSpec::keys)).
//!
//! - [`SmoothRule::QueryRms`]: s_c = 1 / rms(q_c) over the queries that read head's keys (its
//!   GQA group), normalised to a mean of 1 per head. Then E[(s ⊙ q)_c²] is the same for every
//!   channel, so the codebook's Euclidean error on k' is the error in q·k the queries see
//!   (channels taken as uncorrelated; the rotation after it keeps distances): k-means spends its
//!   centroids where the scores are sensitive, not where the keys are wide.
//!
//! All are clamped to at least [`MIN_SCALE`] so a dead channel never divides by zero.

use crate::error::{check_finite, Error, Result};

/// Lower bound of every smoothing scale.
pub const MIN_SCALE: f32 = 1e-4;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
/// How key smoothing scales are calibrated.
pub enum SmoothRule {
    /// s = max|k| per channel (the paper's).
    MaxAbs,
    /// s = √max|k| per channel (measured better on SmolLM2).
    SqrtMaxAbs,
    /// From the queries' second moments.
    QueryRms,
}

impl SmoothRule {
    /// The rule's name in artifacts and flags.
    pub fn name(self) -> &'static str {
        match self {
            SmoothRule::MaxAbs => "max_abs",
            SmoothRule::SqrtMaxAbs => "sqrt_max_abs",
            SmoothRule::QueryRms => "query_rms",
        }
    }

    /// The rule named `s`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "max_abs" => Ok(SmoothRule::MaxAbs),
            "sqrt_max_abs" => Ok(SmoothRule::SqrtMaxAbs),
            "query_rms" => Ok(SmoothRule::QueryRms),
            other => Err(Error::Config(format!("unknown smoothing rule {other:?} (max_abs, sqrt_max_abs, query_rms)"))),
        }
    }

    /// Whether the rule reads the queries (then calibration must pass their second moments).
    pub fn needs_queries(self) -> bool {
        self == SmoothRule::QueryRms
    }
}

/// Smoothing scales for one layer: `[n_kv_heads, head_dim]`, all finite and ≥ [`MIN_SCALE`].
#[derive(Clone, Debug, PartialEq)]
pub struct SmoothScales {
    n_heads: usize,
    head_dim: usize,
    scales: Vec<f32>,
    inverse: Vec<f32>,
}

impl SmoothScales {
    /// Validates and wraps scales laid out `[n_heads, head_dim]`.
    pub fn new(n_heads: usize, head_dim: usize, scales: Vec<f32>) -> Result<Self> {
        if scales.len() != n_heads * head_dim {
            return Err(Error::Shape(format!(
                "smooth scales: {} values for {n_heads} heads × {head_dim} channels",
                scales.len()
            )));
        }
        check_finite("smooth scales", &scales)?;
        if let Some(i) = scales.iter().position(|&s| s < MIN_SCALE) {
            return Err(Error::Config(format!(
                "smooth scale {} at index {i} is below the minimum {MIN_SCALE}",
                scales[i]
            )));
        }
        let inverse = scales.iter().map(|s| 1.0 / s).collect();
        Ok(Self { n_heads, head_dim, scales, inverse })
    }

    /// Computes scales from calibration keys laid out `[tokens, n_heads, head_dim]` (the
    /// key-range rules; [`SmoothRule::QueryRms`] comes from [`Self::from_queries`]).
    pub fn calibrate(keys: &[f32], n_heads: usize, head_dim: usize, rule: SmoothRule) -> Result<Self> {
        if rule.needs_queries() {
            return Err(Error::Config(format!(
                "{} smoothing is calibrated from the queries' second moments, not from keys",
                rule.name()
            )));
        }
        let row = n_heads * head_dim;
        if row == 0 || keys.is_empty() || !keys.len().is_multiple_of(row) {
            return Err(Error::Shape(format!(
                "smooth calibration: {} values are not whole [tokens, {n_heads}, {head_dim}] rows",
                keys.len()
            )));
        }
        check_finite("calibration keys", keys)?;
        let mut max_abs = vec![0.0f32; row];
        for token in keys.chunks_exact(row) {
            for (m, v) in max_abs.iter_mut().zip(token) {
                *m = m.max(v.abs());
            }
        }
        let scales =
            max_abs.into_iter().map(|m| if rule == SmoothRule::MaxAbs { m } else { m.sqrt() }.max(MIN_SCALE)).collect();
        Self::new(n_heads, head_dim, scales)
    }

    /// [`SmoothRule::QueryRms`] scales from `query_ms`, the mean square of each (kv head,
    /// channel)'s queries `[n_heads, head_dim]` (pooled over the head's query group).
    pub fn from_queries(query_ms: &[f32], n_heads: usize, head_dim: usize) -> Result<Self> {
        if query_ms.len() != n_heads * head_dim || head_dim == 0 {
            return Err(Error::Shape(format!(
                "query moments: {} values for {n_heads} heads × {head_dim} channels",
                query_ms.len()
            )));
        }
        check_finite("query moments", query_ms)?;
        let mut scales = Vec::with_capacity(query_ms.len());
        for head in query_ms.chunks_exact(head_dim) {
            let inv: Vec<f32> = head.iter().map(|m| 1.0 / m.max(1e-12).sqrt()).collect();
            let mean = inv.iter().sum::<f32>() / head_dim as f32;
            scales.extend(inv.iter().map(|s| (s / mean).max(MIN_SCALE)));
        }
        Self::new(n_heads, head_dim, scales)
    }

    /// Heads.
    pub fn n_heads(&self) -> usize {
        self.n_heads
    }
    /// Channels per head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    /// All scales, `[n_heads, head_dim]`.
    pub fn as_slice(&self) -> &[f32] {
        &self.scales
    }
    /// Scales of one head.
    pub fn head(&self, h: usize) -> &[f32] {
        &self.scales[h * self.head_dim..(h + 1) * self.head_dim]
    }
    /// Reciprocal scales of one head (multiplying is cheaper than dividing in the hot loop).
    pub fn head_inverse(&self, h: usize) -> &[f32] {
        &self.inverse[h * self.head_dim..(h + 1) * self.head_dim]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_abs_and_sqrt_rules() {
        // 2 tokens, 1 head, 3 channels; channel 2 is dead.
        let keys = [1.0, -4.0, 0.0, -2.0, 3.0, 0.0];
        let s = SmoothScales::calibrate(&keys, 1, 3, SmoothRule::MaxAbs).unwrap();
        assert_eq!(s.as_slice(), &[2.0, 4.0, MIN_SCALE]);
        let s = SmoothScales::calibrate(&keys, 1, 3, SmoothRule::SqrtMaxAbs).unwrap();
        assert_eq!(s.as_slice(), &[2f32.sqrt(), 2.0, MIN_SCALE]);
        assert_eq!(s.head_inverse(0)[1], 0.5);
    }

    #[test]
    fn query_rms_weights_channels_by_how_much_the_queries_read_them() {
        // Head 0: channel 1's queries are 4× channel 0's in rms (16× in mean square).
        let s = SmoothScales::from_queries(&[1.0, 16.0, 4.0, 4.0], 2, 2).unwrap();
        let (h0, h1) = (s.head(0), s.head(1));
        assert!((h0[0] / h0[1] - 4.0).abs() < 1e-5, "{h0:?}");
        assert!(((h0[0] + h0[1]) / 2.0 - 1.0).abs() < 1e-5 && (h1[0] - 1.0).abs() < 1e-6, "{h1:?}");
        // (s ⊙ q) then has the same mean square in every channel of a head.
        assert!((1.0 * h0[0] * h0[0] - 16.0 * h0[1] * h0[1]).abs() < 1e-4);
        assert!(SmoothScales::calibrate(&[1.0, 2.0], 1, 2, SmoothRule::QueryRms).is_err(), "needs queries");
        assert!(SmoothScales::from_queries(&[1.0, f32::NAN], 1, 2).is_err());
        assert!(SmoothScales::from_queries(&[1.0, 2.0, 3.0], 1, 2).is_err());
        assert_eq!(SmoothRule::parse("query_rms").unwrap(), SmoothRule::QueryRms);
    }

    #[test]
    fn rejects_bad_input() {
        assert!(SmoothScales::calibrate(&[1.0, f32::NAN], 1, 2, SmoothRule::MaxAbs).is_err());
        assert!(SmoothScales::calibrate(&[1.0, 2.0, 3.0], 1, 2, SmoothRule::MaxAbs).is_err());
        assert!(SmoothScales::new(1, 2, vec![1.0, 0.0]).is_err());
        assert!(SmoothScales::new(1, 2, vec![1.0, f32::INFINITY]).is_err());
        assert!(SmoothScales::new(2, 2, vec![1.0, 1.0]).is_err());
    }
}
