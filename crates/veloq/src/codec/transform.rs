//! The per-head-vector transform applied before product VQ: x̃ = H (x ⊘ s), either part optional.

use crate::codec::hadamard::Hadamard;
use crate::codec::smooth::SmoothScales;
use crate::element::Element;
use crate::error::{Error, Result};

#[derive(Clone, Debug, PartialEq)]
pub struct RowTransform {
    smooth: Option<SmoothScales>,
    rotation: Option<Hadamard>,
}

impl RowTransform {
    pub fn new(n_heads: usize, head_dim: usize, smooth: Option<SmoothScales>, rotate: bool) -> Result<Self> {
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
        Ok(Self { smooth, rotation })
    }

    pub fn smooth(&self) -> Option<&SmoothScales> {
        self.smooth.as_ref()
    }
    pub fn rotates(&self) -> bool {
        self.rotation.is_some()
    }

    /// x̃ = H (x ⊘ s) for one head vector of head `head`.
    #[inline]
    pub fn forward<T: Element>(&self, head: usize, x: &[T], out: &mut [f32]) {
        match &self.smooth {
            Some(s) => out.iter_mut().zip(x).zip(s.head_inverse(head)).for_each(|((o, v), inv)| *o = v.to_f32() * inv),
            None => out.iter_mut().zip(x).for_each(|(o, v)| *o = v.to_f32()),
        }
        if let Some(h) = &self.rotation {
            h.apply(out);
        }
    }

    /// The query side: q̃ = H (s ⊙ q), so that q·x = q̃·x̃ exactly (before quantization).
    pub fn query(&self, head: usize, q: &[f32], out: &mut [f32]) {
        match &self.smooth {
            Some(s) => out.iter_mut().zip(q).zip(s.head(head)).for_each(|((o, v), s)| *o = v * s),
            None => out.copy_from_slice(q),
        }
        if let Some(h) = &self.rotation {
            h.apply(out);
        }
    }

    /// Undoes [`forward`](Self::forward) in place: rotate back (H is its own inverse), then scale.
    #[inline]
    pub fn inverse(&self, head: usize, x: &mut [f32]) {
        if let Some(h) = &self.rotation {
            h.apply(x);
        }
        if let Some(s) = &self.smooth {
            x.iter_mut().zip(s.head(head)).for_each(|(v, s)| *v *= s);
        }
    }
}
