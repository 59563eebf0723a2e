//! The per-head-vector transform applied before product VQ: x̃ = H ((x − μ) ⊘ s), each part
//! optional. Centering by the calibrated per-channel mean μ matters for keys, which carry a large
//! constant component per channel: left in, every sub-space's codebook spends centroids on it.
//! Attention gets μ back for free: q·k = q·μ + q̃·x̃, and q·μ is one number per query.

use crate::codec::hadamard::Hadamard;
use crate::codec::smooth::SmoothScales;
use crate::element::Element;
use crate::error::{Error, Result};

#[derive(Clone, Debug, PartialEq)]
/// What a VecInfer codec does to a row before and after its codebooks: centering, smoothing, rotation.
pub struct RowTransform {
    /// `[n_heads, head_dim]` channel means, subtracted first.
    mean: Option<Vec<f32>>,
    head_dim: usize,
    smooth: Option<SmoothScales>,
    rotation: Option<Hadamard>,
}

impl RowTransform {
    /// A transform of these parts (each optional).
    pub fn new(
        n_heads: usize,
        head_dim: usize,
        mean: Option<Vec<f32>>,
        smooth: Option<SmoothScales>,
        rotate: bool,
    ) -> Result<Self> {
        if let Some(m) = &mean {
            if m.len() != n_heads * head_dim {
                return Err(Error::Shape(format!(
                    "channel means: {} values for {n_heads} heads × {head_dim}",
                    m.len()
                )));
            }
            crate::error::check_finite("channel means", m)?;
        }
        if let Some(s) = &smooth {
            if s.n_heads() != n_heads || s.head_dim() != head_dim {
                return Err(Error::Shape(format!(
                    "smooth scales for {} heads × {} do not fit {n_heads} × {head_dim}",
                    s.n_heads(),
                    s.head_dim()
                )));
            }
        }
        let rotation = if rotate { Some(Hadamard::new(head_dim)?) } else { None };
        Ok(Self { mean, head_dim, smooth, rotation })
    }

    /// The calibrated per-(head, channel) mean, when centering.
    pub fn mean(&self) -> Option<&[f32]> {
        self.mean.as_deref()
    }
    fn head_mean(&self, head: usize) -> Option<&[f32]> {
        self.mean.as_deref().map(|m| &m[head * self.head_dim..(head + 1) * self.head_dim])
    }
    /// The smoothing scales, when smoothing.
    pub fn smooth(&self) -> Option<&SmoothScales> {
        self.smooth.as_ref()
    }
    /// Whether rows are Hadamard-rotated.
    pub fn rotates(&self) -> bool {
        self.rotation.is_some()
    }

    /// x̃ = H ((x − μ) ⊘ s) for one head vector of head `head`.
    #[inline]
    pub fn forward<T: Element>(&self, head: usize, x: &[T], out: &mut [f32]) {
        out.iter_mut().zip(x).for_each(|(o, v)| *o = v.to_f32());
        if let Some(m) = self.head_mean(head) {
            out.iter_mut().zip(m).for_each(|(o, m)| *o -= m);
        }
        if let Some(s) = &self.smooth {
            out.iter_mut().zip(s.head_inverse(head)).for_each(|(o, inv)| *o *= inv);
        }
        if let Some(h) = &self.rotation {
            h.apply(out);
        }
    }

    /// The query side: q̃ = H (s ⊙ q), so that q·x = q̃·x̃ + [`query_offset`](Self::query_offset)
    /// exactly (before quantization).
    pub fn query(&self, head: usize, q: &[f32], out: &mut [f32]) {
        match &self.smooth {
            Some(s) => out.iter_mut().zip(q).zip(s.head(head)).for_each(|((o, v), s)| *o = v * s),
            None => out.copy_from_slice(q),
        }
        if let Some(h) = &self.rotation {
            h.apply(out);
        }
    }

    /// q·μ for head `head` (0 without centering).
    pub fn query_offset(&self, head: usize, q: &[f32]) -> f32 {
        self.head_mean(head).map_or(0.0, |m| q.iter().zip(m).map(|(a, b)| a * b).sum())
    }

    /// Undoes [`forward`](Self::forward) in place: rotate back (H is its own inverse), scale, add μ.
    #[inline]
    pub fn inverse(&self, head: usize, x: &mut [f32]) {
        self.inverse_weighted(head, x, 1.0)
    }

    /// The inverse of a weighted sum Σ wᵢ x̃ᵢ with Σ wᵢ = `weight`: the mean comes back `weight`
    /// times (attention weights over codes sum to less than 1 when a window shares the softmax).
    #[inline]
    pub fn inverse_weighted(&self, head: usize, x: &mut [f32], weight: f32) {
        if let Some(h) = &self.rotation {
            h.apply(x);
        }
        if let Some(s) = &self.smooth {
            x.iter_mut().zip(s.head(head)).for_each(|(v, s)| *v *= s);
        }
        if let Some(m) = self.head_mean(head) {
            x.iter_mut().zip(m).for_each(|(v, m)| *v += weight * m);
        }
    }
}
