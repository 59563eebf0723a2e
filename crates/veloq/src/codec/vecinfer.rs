//! The VecInfer codec for one layer's keys or values: optional per-channel smoothing, optional
//! Hadamard rotation, product VQ over sub-vectors, bit-packed codes.
//!
//! encode: x̃ = H (x ⊘ s) per head vector, code_j = argmin_c ‖x̃_j − C_j[c]‖².
//! decode: x ≈ s ⊙ H x̂ with x̂ the concatenated centroids (H is its own inverse).
//! Attention never decodes keys: q·k ≈ (H (s ⊙ q))·x̂, see [`VecInferCodec::transform_query`].

use crate::codec::block::BlockCodec;
use crate::codec::codebook::{CodebookSet, Granularity, PqShape};
use crate::codec::hadamard::MAX_HEAD_DIM;
use crate::codec::pack::{packed_len, unpack_unchecked};
use crate::codec::search::{quantize_rows, Metric};
use crate::codec::smooth::{SmoothRule, SmoothScales};
use crate::codec::transform::RowTransform;
use crate::element::Element;
use crate::error::{Error, Result};

/// What a VecInfer codec is made of, before calibration fills in scales and codebooks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CodecSpec {
    /// Codebook shape.
    pub shape: PqShape,
    /// One codebook per layer or per sub-space.
    pub granularity: Granularity,
    /// Subtract the calibrated per-channel mean first.
    pub center: bool,
    /// Smoothing rule, or `None` for no smoothing (the default for values).
    pub smooth: Option<SmoothRule>,
    /// Rotate rows by the Hadamard transform first.
    pub rotate: bool,
}

impl CodecSpec {
    /// Keys: smooth by √max|k| (measured better than the paper's max|k| on SmolLM2, see
    /// `veloq bench smooth`), rotate, one codebook per layer.
    pub fn keys(shape: PqShape) -> Self {
        Self {
            shape,
            granularity: Granularity::PerLayer,
            center: true,
            smooth: Some(SmoothRule::SqrtMaxAbs),
            rotate: true,
        }
    }
    /// Values: rotated, not smoothed (no outlier channels to tame).
    pub fn values(shape: PqShape) -> Self {
        Self { shape, granularity: Granularity::PerLayer, center: true, smooth: None, rotate: true }
    }
}

/// A calibrated codec for `[tokens, n_heads, head_dim]` tensors of one layer.
#[derive(Clone, Debug, PartialEq)]
pub struct VecInferCodec {
    n_heads: usize,
    head_dim: usize,
    transform: RowTransform,
    books: CodebookSet,
    metric: Metric,
}

impl VecInferCodec {
    /// Assembles a codec, checking that scales and codebooks fit the geometry.
    pub fn new(
        n_heads: usize,
        head_dim: usize,
        mean: Option<Vec<f32>>,
        smooth: Option<SmoothScales>,
        rotate: bool,
        books: CodebookSet,
    ) -> Result<Self> {
        if n_heads == 0 || head_dim == 0 || head_dim > MAX_HEAD_DIM {
            return Err(Error::Shape(format!(
                "codec geometry {n_heads} heads × {head_dim} (head_dim ≤ {MAX_HEAD_DIM})"
            )));
        }
        books.shape().subspaces(head_dim)?;
        let transform = RowTransform::new(n_heads, head_dim, mean, smooth, rotate)?;
        Ok(Self { n_heads, head_dim, transform, books, metric: Metric::Expanded })
    }

    /// Chooses the search's distance form (both give the same codes except on near-ties).
    pub fn with_metric(mut self, metric: Metric) -> Self {
        self.metric = metric;
        self
    }

    /// Heads of a row.
    pub fn n_heads(&self) -> usize {
        self.n_heads
    }
    /// Channels per head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    /// The smoothing scales, when smoothing.
    pub fn smooth(&self) -> Option<&SmoothScales> {
        self.transform.smooth()
    }
    /// The calibrated mean, when centering.
    pub fn mean(&self) -> Option<&[f32]> {
        self.transform.mean()
    }
    /// Whether rows are rotated.
    pub fn rotates(&self) -> bool {
        self.transform.rotates()
    }
    /// The codebooks.
    pub fn books(&self) -> &CodebookSet {
        &self.books
    }
    /// The codebooks' shape.
    pub fn shape(&self) -> PqShape {
        self.books.shape()
    }
    /// Codes per head vector.
    pub fn subspaces(&self) -> usize {
        self.head_dim / self.books.shape().sub_dim
    }
    /// Packed bytes for `tokens` tokens (all heads).
    pub fn code_bytes(&self, tokens: usize) -> usize {
        packed_len(tokens * self.n_heads * self.subspaces(), self.books.shape().bits)
    }

    /// The transform applied before the search (smoothing, rotation).
    pub fn transform(&self) -> &RowTransform {
        &self.transform
    }

    /// The query in code space: q̃ = H (s ⊙ q), so that q·k ≈ q̃·x̂ (x̂ the key's centroids).
    pub fn transform_query(&self, head: usize, q: &[f32], out: &mut [f32]) {
        self.transform.query(head, q, out)
    }

    fn check_tokens(&self, len: usize, what: &str) -> Result<usize> {
        let row = self.n_heads * self.head_dim;
        if !len.is_multiple_of(row) {
            return Err(Error::Shape(format!(
                "{what}: {len} values are not whole [tokens, {}, {}] rows",
                self.n_heads, self.head_dim
            )));
        }
        Ok(len / row)
    }

    /// Encodes `x` (`[tokens, n_heads, head_dim]`) into `out` ([`code_bytes`](Self::code_bytes)):
    /// smoothing, rotation, search and packing fused per block of rows.
    pub fn encode<T: Element>(&self, x: &[T], out: &mut [u8]) -> Result<()> {
        let tokens = self.check_tokens(x.len(), "encode")?;
        let d = self.head_dim;
        quantize_rows(
            tokens * self.n_heads,
            d,
            &self.books,
            self.metric,
            |r, buf| self.transform.forward(r % self.n_heads, &x[r * d..(r + 1) * d], buf),
            out,
        )
    }

    /// Convenience: encode into a new buffer.
    pub fn encode_vec<T: Element>(&self, x: &[T]) -> Result<Vec<u8>> {
        let tokens = self.check_tokens(x.len(), "encode")?;
        let mut out = vec![0u8; self.code_bytes(tokens)];
        self.encode(x, &mut out)?;
        Ok(out)
    }

    /// Decodes `codes` into `out` (`[tokens, n_heads, head_dim]`, tokens from `out.len()`).
    pub fn decode(&self, codes: &[u8], out: &mut [f32]) -> Result<()> {
        let tokens = self.check_tokens(out.len(), "decode")?;
        if codes.len() != self.code_bytes(tokens) {
            return Err(Error::Shape(format!(
                "decode: {tokens} tokens need {} code bytes, got {}",
                self.code_bytes(tokens),
                codes.len()
            )));
        }
        let (d, m, sd, bits) = (self.head_dim, self.subspaces(), self.books.shape().sub_dim, self.books.shape().bits);
        // Rows in groups of 8 start on byte boundaries of the packed stream.
        let group = 8;
        use rayon::prelude::*;
        out.par_chunks_mut(group * d).enumerate().for_each(|(g, rows)| {
            let n = rows.len() / d;
            let start = packed_len(g * group * m, bits);
            let mut idx = vec![0u16; n * m];
            unpack_unchecked(&codes[start..start + packed_len(n * m, bits)], bits, &mut idx);
            for (i, row) in rows.chunks_exact_mut(d).enumerate() {
                for j in 0..m {
                    let c = self.books.book(j).centroid(idx[i * m + j] as usize);
                    row[j * sd..(j + 1) * sd].copy_from_slice(c);
                }
                self.transform.inverse((g * group + i) % self.n_heads, row);
            }
        });
        Ok(())
    }
}

impl BlockCodec for VecInferCodec {
    fn name(&self) -> String {
        let s = self.shape();
        format!("vecinfer-{}x{}b", s.sub_dim, s.bits)
    }
    fn n_heads(&self) -> usize {
        self.n_heads
    }
    fn head_dim(&self) -> usize {
        self.head_dim
    }
    fn encoded_len(&self, tokens: usize) -> usize {
        self.code_bytes(tokens)
    }
    fn encode(&self, rows: &[f32], out: &mut [u8]) -> Result<()> {
        VecInferCodec::encode(self, rows, out)
    }
    fn decode(&self, bytes: &[u8], out: &mut [f32]) -> Result<()> {
        VecInferCodec::decode(self, bytes, out)
    }
    fn resident_bytes(&self) -> usize {
        self.books.resident_bytes()
            + self.smooth().map_or(0, |s| s.as_slice().len() * 4)
            + self.mean().map_or(0, |m| m.len() * 4)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calibrate::{train_codec, KMeansConfig};
    use crate::testing::{fresh_seed, outlier_rows, rng};

    fn rel_mse(x: &[f32], y: &[f32]) -> f64 {
        let e: f64 = x.iter().zip(y).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
        let s: f64 = x.iter().map(|a| (*a as f64).powi(2)).sum();
        e / s
    }

    /// Round trip on held-out data within the codebook's training error, for every granularity
    /// and with/without each transform; more bits never hurt.
    #[test]
    fn decode_encode_reconstructs_within_codebook_error() {
        let seed = fresh_seed();
        let mut r = rng(seed);
        let (heads, dim) = (2, 64);
        let train = outlier_rows(&mut r, 1500 * heads, dim);
        let test = outlier_rows(&mut r, 101 * heads, dim);
        let mut prev = f64::INFINITY;
        for bits in [4u32, 6, 8] {
            for granularity in [Granularity::PerLayer, Granularity::PerSubspace] {
                for (smooth, rotate) in
                    [(None, false), (Some(SmoothRule::MaxAbs), true), (Some(SmoothRule::SqrtMaxAbs), true)]
                {
                    let spec = CodecSpec {
                        shape: PqShape::new(4, bits).unwrap(),
                        granularity,
                        center: smooth.is_some(),
                        smooth,
                        rotate,
                    };
                    let (codec, reports) =
                        train_codec(&train, heads, dim, &spec, &KMeansConfig::new(1 << bits, seed)).unwrap();
                    let codes = codec.encode_vec(&test).unwrap();
                    assert_eq!(codes.len(), 101 * heads * 16 * bits as usize / 8);
                    let mut back = vec![f32::NAN; test.len()];
                    codec.decode(&codes, &mut back).unwrap();
                    let err = rel_mse(&test, &back);
                    // Training error in the original space is bounded by the k-means error scaled
                    // by the smoothing; held-out error stays within a small factor of it.
                    assert!(err.is_finite() && err < 0.6, "seed {seed} {spec:?}: {err}");
                    let _ = reports;
                    if granularity == Granularity::PerLayer && smooth.is_none() {
                        assert!(err < prev, "seed {seed}: {bits} bits gave {err} ≥ {prev}");
                        prev = err;
                    }
                }
            }
        }
    }

    /// q·k through the transformed query plus the centering offset equals q·decode(k) (the
    /// identity attention relies on).
    #[test]
    fn query_transform_preserves_scores() {
        let seed = fresh_seed();
        let mut r = rng(seed);
        let (heads, dim) = (2, 128);
        let train = outlier_rows(&mut r, 600 * heads, dim);
        let spec = CodecSpec::keys(PqShape::new(8, 8).unwrap());
        let (codec, _) = train_codec(&train, heads, dim, &spec, &KMeansConfig::new(256, seed)).unwrap();
        let k = outlier_rows(&mut r, 3 * heads, dim);
        let codes = codec.encode_vec(&k).unwrap();
        let mut kd = vec![0.0; k.len()];
        codec.decode(&codes, &mut kd).unwrap();
        let q = crate::testing::normal(&mut r, dim, 1.0);
        for row in 0..3 * heads {
            let h = row % heads;
            let mut qt = vec![0.0; dim];
            codec.transform_query(h, &q, &mut qt);
            // x̂ of this row: centroids in code space.
            let mut xh = vec![0.0; dim];
            for j in 0..codec.subspaces() {
                let c = crate::codec::pack::get(&codes, 8, row * codec.subspaces() + j);
                xh[j * 8..(j + 1) * 8].copy_from_slice(codec.books().book(j).centroid(c as usize));
            }
            let a: f32 = qt.iter().zip(&xh).map(|(a, b)| a * b).sum::<f32>() + codec.transform().query_offset(h, &q);
            let b: f32 = q.iter().zip(&kd[row * dim..(row + 1) * dim]).map(|(a, b)| a * b).sum();
            assert!((a - b).abs() <= 1e-3 * (1.0 + b.abs()), "seed {seed}: {a} vs {b}");
        }
    }

    #[test]
    fn shape_errors() {
        let mut r = rng(1);
        let train = outlier_rows(&mut r, 300, 64);
        let spec = CodecSpec::values(PqShape::new(8, 4).unwrap());
        let (codec, _) = train_codec(&train, 1, 64, &spec, &KMeansConfig::new(16, 1)).unwrap();
        assert!(codec.encode_vec(&train[..63]).is_err());
        let mut out = vec![0.0; 64];
        assert!(codec.decode(&[0u8; 3], &mut out).is_err());
        assert!(codec.decode(&[0u8; 4], &mut out[..10]).is_err());
        let mut bad = train.clone();
        bad[3] = f32::INFINITY;
        assert!(codec.encode_vec(&bad).is_err());
    }
}
