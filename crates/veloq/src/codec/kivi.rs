//! KIVI-style asymmetric scalar quantization (Liu et al., 2024): keys per channel (a group spans
//! `group` tokens of one channel, since key outliers live in fixed channels), values per token (a
//! group spans `group` channels of one token). Each group stores min and step as f16 and
//! `bits`-bit codes: x ≈ min + step · q, q = round((x − min) / step).

use half::f16;

pub use crate::codec::block::KiviAxis;
use crate::codec::block::{check_encoded, whole_rows, BlockCodec, ScalarForm};
use crate::codec::pack::{pack_unchecked, packed_len, unpack_unchecked};
use crate::error::{check_finite, Error, Result};

#[derive(Clone, Debug, PartialEq)]
/// KIVI-style asymmetric scalar quantization of one layer's keys (per channel) or values (per token).
pub struct KiviCodec {
    n_heads: usize,
    head_dim: usize,
    bits: u32,
    group: usize,
    axis: KiviAxis,
}

impl KiviCodec {
    /// A codec of `bits`-bit codes over groups of `group` along `axis`.
    pub fn new(n_heads: usize, head_dim: usize, bits: u32, group: usize, axis: KiviAxis) -> Result<Self> {
        if !(1..=8).contains(&bits) {
            return Err(Error::Config(format!("KIVI: {bits} bits outside 1..=8")));
        }
        if group == 0 || !group.is_multiple_of(8) {
            return Err(Error::Config(format!("KIVI: group {group} must be a positive multiple of 8")));
        }
        if axis == KiviAxis::PerToken && !head_dim.is_multiple_of(group) {
            return Err(Error::Config(format!("KIVI: value group {group} does not divide head_dim {head_dim}")));
        }
        if n_heads == 0 || head_dim == 0 {
            return Err(Error::Shape("KIVI: empty geometry".into()));
        }
        Ok(Self { n_heads, head_dim, bits, group, axis })
    }

    fn row(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// (min, step) groups for `tokens` tokens.
    fn groups(&self, tokens: usize) -> usize {
        tokens * self.row() / self.group
    }

    /// Element indices of group `g` within a token-major block, in code order.
    fn members(&self, g: usize) -> impl Iterator<Item = usize> + '_ {
        let (row, group) = (self.row(), self.group);
        let per_channel = self.axis == KiviAxis::PerChannel;
        // PerChannel: group g covers channel g % row of tokens [g / row · group, +group).
        let (base, stride) = if per_channel { ((g / row) * group * row + g % row, row) } else { (g * group, 1) };
        (0..group).map(move |i| base + i * stride)
    }
}

impl BlockCodec for KiviCodec {
    fn name(&self) -> String {
        format!("kivi-{}b-g{}", self.bits, self.group)
    }
    fn n_heads(&self) -> usize {
        self.n_heads
    }
    fn head_dim(&self) -> usize {
        self.head_dim
    }
    fn block_tokens(&self) -> usize {
        match self.axis {
            KiviAxis::PerChannel => self.group,
            KiviAxis::PerToken => 1,
        }
    }
    fn encoded_len(&self, tokens: usize) -> usize {
        self.groups(tokens) * 4 + packed_len(tokens * self.row(), self.bits)
    }

    fn encode(&self, rows: &[f32], out: &mut [u8]) -> Result<()> {
        let tokens = whole_rows(rows.len(), self.n_heads, self.head_dim, "KIVI encode")?;
        if tokens % self.block_tokens() != 0 {
            return Err(Error::Shape(format!(
                "KIVI encode: {tokens} tokens, not a multiple of {}",
                self.block_tokens()
            )));
        }
        if out.len() != self.encoded_len(tokens) {
            return Err(Error::Shape(format!(
                "KIVI encode: output of {} bytes, need {}",
                out.len(),
                self.encoded_len(tokens)
            )));
        }
        check_finite("KIVI input", rows)?;
        let levels = ((1u32 << self.bits) - 1) as f32;
        let mut codes = vec![0u16; rows.len()];
        let (meta, packed) = out.split_at_mut(self.groups(tokens) * 4);
        for g in 0..self.groups(tokens) {
            let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
            for i in self.members(g) {
                lo = lo.min(rows[i]);
                hi = hi.max(rows[i]);
            }
            // Quantize against the f16-rounded parameters the decoder will see.
            let min = f16::from_f32(lo);
            let step = f16::from_f32((hi - lo) / levels);
            let (m, s) = (min.to_f32(), step.to_f32());
            let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
            for i in self.members(g) {
                codes[i] = ((rows[i] - m) * inv).round().clamp(0.0, levels) as u16;
            }
            meta[g * 4..g * 4 + 2].copy_from_slice(&min.to_le_bytes());
            meta[g * 4 + 2..g * 4 + 4].copy_from_slice(&step.to_le_bytes());
        }
        pack_unchecked(&codes, self.bits, packed);
        Ok(())
    }

    fn decode(&self, bytes: &[u8], out: &mut [f32]) -> Result<()> {
        let tokens = check_encoded(self, bytes, out.len())?;
        let (meta, packed) = bytes.split_at(self.groups(tokens) * 4);
        let mut codes = vec![0u16; out.len()];
        unpack_unchecked(packed, self.bits, &mut codes);
        for g in 0..self.groups(tokens) {
            let min = f16::from_le_bytes([meta[g * 4], meta[g * 4 + 1]]).to_f32();
            let step = f16::from_le_bytes([meta[g * 4 + 2], meta[g * 4 + 3]]).to_f32();
            for i in self.members(g) {
                out[i] = min + step * codes[i] as f32;
            }
        }
        Ok(())
    }

    fn resident_bytes(&self) -> usize {
        0
    }
    fn scalar_form(&self) -> Option<ScalarForm<'_>> {
        Some(ScalarForm::Kivi { bits: self.bits, group: self.group, axis: self.axis })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{fresh_seed, outlier_rows, rng};

    /// Every element lands within half a step of its group's grid, for both axes and bit widths;
    /// 4 bits beat 2 bits; sizes are the nominal bits plus 32 bits of metadata per group.
    #[test]
    fn round_trip_within_half_a_step() {
        let seed = fresh_seed();
        let mut r = rng(seed);
        let (heads, dim, tokens) = (3, 64, 96);
        let x = outlier_rows(&mut r, tokens * heads, dim);
        for axis in [KiviAxis::PerChannel, KiviAxis::PerToken] {
            let mut prev = f64::INFINITY;
            for bits in [2u32, 4] {
                let c = KiviCodec::new(heads, dim, bits, 32, axis).unwrap();
                let bytes = c.encode_vec(&x).unwrap();
                assert_eq!(bytes.len(), tokens * heads * dim * (bits as usize + 1) / 8);
                assert!((c.bits_per_element(tokens) - (bits as f64 + 1.0)).abs() < 1e-9);
                let mut y = vec![f32::NAN; x.len()];
                c.decode(&bytes, &mut y).unwrap();
                for g in 0..c.groups(tokens) {
                    let idx: Vec<usize> = c.members(g).collect();
                    let lo = idx.iter().map(|&i| x[i]).fold(f32::INFINITY, f32::min);
                    let hi = idx.iter().map(|&i| x[i]).fold(f32::NEG_INFINITY, f32::max);
                    let step = (hi - lo) / ((1 << bits) - 1) as f32;
                    for &i in &idx {
                        // Half a step plus the f16 rounding of min and step (≤ 2⁻¹¹ relative).
                        let tol = 0.5 * step + 2e-3 * (lo.abs() + hi.abs()) + 1e-6;
                        assert!((x[i] - y[i]).abs() <= tol, "seed {seed} {axis:?} {bits}b: {} vs {}", x[i], y[i]);
                    }
                }
                let err: f64 = x.iter().zip(&y).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
                assert!(err < prev, "seed {seed}");
                prev = err;
            }
        }
    }

    #[test]
    fn rejects_bad_input() {
        assert!(KiviCodec::new(2, 64, 3, 12, KiviAxis::PerToken).is_err());
        assert!(KiviCodec::new(2, 48, 2, 32, KiviAxis::PerToken).is_err());
        assert!(KiviCodec::new(2, 64, 9, 32, KiviAxis::PerChannel).is_err());
        let c = KiviCodec::new(1, 64, 2, 32, KiviAxis::PerChannel).unwrap();
        assert!(c.encode_vec(&vec![1.0; 64 * 31]).is_err()); // not a whole group of tokens
        let mut x = vec![1.0; 64 * 32];
        x[7] = f32::NAN;
        assert!(c.encode_vec(&x).is_err());
        let mut out = vec![0.0; 64 * 32];
        assert!(c.decode(&[0u8; 5], &mut out).is_err());
    }
}
