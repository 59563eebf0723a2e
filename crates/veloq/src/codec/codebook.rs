//! Codebooks of product VQ: `2^bits` centroids of `sub_dim` floats, one per layer shared across
//! sub-spaces or one per sub-space.

use crate::error::{check_finite, Error, Result};

/// Supported sub-vector lengths; the kernels are specialised for each.
pub const SUB_DIMS: [usize; 3] = [2, 4, 8];
/// Supported codebook sizes in bits (16 to 4096 centroids).
pub const BITS_RANGE: std::ops::RangeInclusive<u32> = 4..=12;

/// Shape of the product quantizer: bits/element = `bits / sub_dim`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PqShape {
    /// Channels per sub-vector (2, 4 or 8).
    pub sub_dim: usize,
    /// Bits per code (4–12).
    pub bits: u32,
}

impl PqShape {
    /// A shape, or an error naming what is out of range.
    pub fn new(sub_dim: usize, bits: u32) -> Result<Self> {
        if !SUB_DIMS.contains(&sub_dim) {
            return Err(Error::Config(format!("sub_dim {sub_dim} not in {SUB_DIMS:?}")));
        }
        if !BITS_RANGE.contains(&bits) {
            return Err(Error::Config(format!("codebook_bits {bits} outside {BITS_RANGE:?}")));
        }
        Ok(Self { sub_dim, bits })
    }
    /// Centroids per codebook.
    pub fn centroids(&self) -> usize {
        1 << self.bits
    }
    /// Bits per element of the codes.
    pub fn bits_per_element(&self) -> f64 {
        self.bits as f64 / self.sub_dim as f64
    }
    /// Sub-vectors per head vector, checking that `head_dim` splits evenly.
    pub fn subspaces(&self, head_dim: usize) -> Result<usize> {
        if head_dim == 0 || !head_dim.is_multiple_of(self.sub_dim) {
            return Err(Error::Shape(format!("head_dim {head_dim} is not a multiple of sub_dim {}", self.sub_dim)));
        }
        Ok(head_dim / self.sub_dim)
    }
}

/// Whether one codebook serves every sub-space of a layer or each sub-space has its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Granularity {
    /// One codebook for every sub-space of a layer.
    PerLayer,
    /// A codebook per sub-space.
    PerSubspace,
}

impl Granularity {
    /// `per_layer` or `per_subspace`.
    pub fn name(self) -> &'static str {
        match self {
            Granularity::PerLayer => "per_layer",
            Granularity::PerSubspace => "per_subspace",
        }
    }
    /// The granularity named `s`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "per_layer" => Ok(Granularity::PerLayer),
            "per_subspace" => Ok(Granularity::PerSubspace),
            other => Err(Error::Config(format!("unknown codebook granularity {other:?} (per_layer, per_subspace)"))),
        }
    }
}

/// One codebook with the derived data the search kernels read: `-2c` and `‖c‖²`.
#[derive(Clone, Debug, PartialEq)]
pub struct Codebook {
    sub_dim: usize,
    centroids: Vec<f32>,
    neg2: Vec<f32>,
    norms: Vec<f32>,
}

impl Codebook {
    /// Wraps `k × sub_dim` centroids (row-major), rejecting empty, ragged or non-finite input.
    pub fn new(sub_dim: usize, centroids: Vec<f32>) -> Result<Self> {
        if sub_dim == 0 || centroids.is_empty() || !centroids.len().is_multiple_of(sub_dim) {
            return Err(Error::Shape(format!(
                "codebook: {} values are not whole centroids of {sub_dim}",
                centroids.len()
            )));
        }
        let k = centroids.len() / sub_dim;
        if k > 1 << 16 {
            return Err(Error::Shape(format!("codebook: {k} centroids exceed 16-bit codes")));
        }
        check_finite("codebook", &centroids)?;
        let neg2 = centroids.iter().map(|c| -2.0 * c).collect();
        let norms = centroids.chunks_exact(sub_dim).map(|c| c.iter().map(|v| v * v).sum()).collect();
        Ok(Self { sub_dim, centroids, neg2, norms })
    }
    /// Channels per centroid.
    pub fn sub_dim(&self) -> usize {
        self.sub_dim
    }
    /// Centroids.
    pub fn len(&self) -> usize {
        self.norms.len()
    }
    /// Whether it holds no centroid.
    pub fn is_empty(&self) -> bool {
        self.norms.is_empty()
    }
    /// Centroids, row-major `[len, sub_dim]`.
    pub fn centroids(&self) -> &[f32] {
        &self.centroids
    }
    /// Centroid `k`.
    pub fn centroid(&self, k: usize) -> &[f32] {
        &self.centroids[k * self.sub_dim..(k + 1) * self.sub_dim]
    }
    /// `-2 × centroids`, same layout.
    pub fn neg2(&self) -> &[f32] {
        &self.neg2
    }
    /// `‖c‖²` per centroid.
    pub fn norms(&self) -> &[f32] {
        &self.norms
    }
}

/// The codebooks of one quantizer: one shared, or one per sub-space.
#[derive(Clone, Debug, PartialEq)]
pub struct CodebookSet {
    shape: PqShape,
    granularity: Granularity,
    books: Vec<Codebook>,
}

impl CodebookSet {
    /// Checks that every book has `2^bits` centroids of `sub_dim` and that the count of books
    /// matches the granularity (`subspaces` books for per-sub-space).
    pub fn new(shape: PqShape, granularity: Granularity, subspaces: usize, books: Vec<Codebook>) -> Result<Self> {
        let want = match granularity {
            Granularity::PerLayer => 1,
            Granularity::PerSubspace => subspaces,
        };
        if books.len() != want {
            return Err(Error::Shape(format!(
                "{} codebooks for granularity {} with {subspaces} sub-spaces (want {want})",
                books.len(),
                granularity.name()
            )));
        }
        for (i, b) in books.iter().enumerate() {
            if b.sub_dim() != shape.sub_dim || b.len() != shape.centroids() {
                return Err(Error::Shape(format!(
                    "codebook {i}: {} centroids of {} (want {} of {})",
                    b.len(),
                    b.sub_dim(),
                    shape.centroids(),
                    shape.sub_dim
                )));
            }
        }
        Ok(Self { shape, granularity, books })
    }
    /// The quantizer's shape.
    pub fn shape(&self) -> PqShape {
        self.shape
    }
    /// One codebook per layer or per sub-space.
    pub fn granularity(&self) -> Granularity {
        self.granularity
    }
    /// The distinct codebooks.
    pub fn books(&self) -> &[Codebook] {
        &self.books
    }
    /// Index into [`books`](Self::books) of the codebook sub-space `j` uses.
    #[inline]
    pub fn book_index(&self, j: usize) -> usize {
        match self.granularity {
            Granularity::PerLayer => 0,
            Granularity::PerSubspace => j,
        }
    }
    /// The codebook of sub-space `j`.
    #[inline]
    pub fn book(&self, j: usize) -> &Codebook {
        &self.books[self.book_index(j)]
    }
    /// Bytes the codebooks occupy as stored (f32 centroids).
    pub fn resident_bytes(&self) -> usize {
        self.books.iter().map(|b| b.centroids().len() * 4).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_validation() {
        assert!(PqShape::new(8, 8).is_ok());
        assert!(PqShape::new(3, 8).is_err());
        assert!(PqShape::new(8, 3).is_err());
        assert!(PqShape::new(8, 13).is_err());
        let s = PqShape::new(4, 8).unwrap();
        assert_eq!(s.bits_per_element(), 2.0);
        assert_eq!(s.subspaces(128).unwrap(), 32);
        assert!(s.subspaces(130).is_err());
    }

    #[test]
    fn codebook_derived_data() {
        let b = Codebook::new(2, vec![1.0, 2.0, -3.0, 0.5]).unwrap();
        assert_eq!(b.len(), 2);
        assert_eq!(b.norms(), &[5.0, 9.25]);
        assert_eq!(b.neg2(), &[-2.0, -4.0, 6.0, -1.0]);
        assert!(Codebook::new(2, vec![1.0, f32::NAN]).is_err());
        assert!(Codebook::new(2, vec![1.0, 2.0, 3.0]).is_err());
    }

    #[test]
    fn set_checks_count_and_size() {
        let shape = PqShape::new(2, 4).unwrap();
        let book = || Codebook::new(2, vec![0.5; 32]).unwrap();
        assert!(CodebookSet::new(shape, Granularity::PerLayer, 4, vec![book()]).is_ok());
        assert!(CodebookSet::new(shape, Granularity::PerSubspace, 4, vec![book()]).is_err());
        assert!(CodebookSet::new(shape, Granularity::PerSubspace, 2, vec![book(), book()]).is_ok());
        let small = Codebook::new(2, vec![0.5; 16]).unwrap();
        assert!(CodebookSet::new(shape, Granularity::PerLayer, 4, vec![small]).is_err());
    }
}
