//! The seam between codecs and caches: a codec turns `[tokens, n_heads, head_dim]` rows into
//! bytes and back. Caches store those bytes per flushed block and never look inside, so every
//! method (VecInfer, KIVI, rotation + Lloyd-Max) plugs into the same cache.

use crate::error::{Error, Result};

/// What a scalar codec computes, element by element, for backends that run it in their own
/// tensor ops (a GPU without veloq's kernels for it) instead of through `encode`/`decode`.
#[derive(Clone, Copy, Debug)]
pub enum ScalarForm<'a> {
    /// KIVI: `min + step · q` per group of `group` tokens of one channel (`PerChannel`) or of
    /// `group` channels of one token (`PerToken`), min and step as f16.
    /// KIVI's rule.
    Kivi {
        /// Bits per code.
        bits: u32,
        /// Group length.
        group: usize,
        /// Which way a group runs.
        axis: KiviAxis,
    },
    /// Rotation + Lloyd–Max: y = H(signs ⊙ x) / rms(y) coded as the number of `bounds` below
    /// each element, decoded as `levels[q] · rms`, rms as f16.
    /// Rotation + Lloyd–Max's rule.
    LloydMax {
        /// Bits per code.
        bits: u32,
        /// Random signs applied before the rotation, per channel.
        signs: &'a [f32],
        /// Reconstruction levels of a unit Gaussian.
        levels: &'a [f32],
        /// Decision boundaries between the levels.
        bounds: &'a [f32],
    },
}

/// Which way a KIVI group runs (the scalar form names it, so it lives beside the seam).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KiviAxis {
    /// Keys: groups run along tokens, one per channel.
    PerChannel,
    /// Values: groups run along channels, one per token.
    PerToken,
}

/// A codec of one layer's keys or values: rows in, bytes out, and back.
pub trait BlockCodec: Send + Sync + std::fmt::Debug {
    /// Short name for tables, e.g. `kivi-2b-g32`.
    fn name(&self) -> String;
    /// Key/value heads of a row.
    fn n_heads(&self) -> usize;
    /// Channels per head.
    fn head_dim(&self) -> usize;
    /// Encode calls take a multiple of this many tokens (KIVI keys group over tokens).
    fn block_tokens(&self) -> usize {
        1
    }
    /// Bytes that `tokens` tokens encode to, metadata included.
    fn encoded_len(&self, tokens: usize) -> usize;
    /// Encodes `rows` (`[tokens, n_heads, head_dim]`, tokens a multiple of
    /// [`block_tokens`](Self::block_tokens)) into `out` of [`encoded_len`](Self::encoded_len).
    fn encode(&self, rows: &[f32], out: &mut [u8]) -> Result<()>;
    /// Decodes `bytes` into `out` (`[tokens, n_heads, head_dim]`, tokens from `out.len()`).
    fn decode(&self, bytes: &[u8], out: &mut [f32]) -> Result<()>;
    /// Bytes held by the codec itself (codebooks, scales, levels), shared by all positions.
    fn resident_bytes(&self) -> usize;
    /// The element-wise rule, for scalar codecs that other backends may run in their own ops.
    fn scalar_form(&self) -> Option<ScalarForm<'_>> {
        None
    }

    /// Stored bits per element over `tokens` tokens, everything counted: per-group metadata and
    /// this codec's own tables amortised over the tokens.
    fn bits_per_element(&self, tokens: usize) -> f64 {
        let elems = (tokens * self.n_heads() * self.head_dim()) as f64;
        ((self.encoded_len(tokens) + self.resident_bytes()) * 8) as f64 / elems
    }

    /// [`encode`](Self::encode) into a new buffer.
    fn encode_vec(&self, rows: &[f32]) -> Result<Vec<u8>> {
        let tokens = whole_rows(rows.len(), self.n_heads(), self.head_dim(), "encode")?;
        let mut out = vec![0u8; self.encoded_len(tokens)];
        self.encode(rows, &mut out)?;
        Ok(out)
    }
}

/// Tokens in a buffer of `len` values, or a shape error naming `what`.
pub fn whole_rows(len: usize, n_heads: usize, head_dim: usize, what: &str) -> Result<usize> {
    let row = n_heads * head_dim;
    if row == 0 || !len.is_multiple_of(row) {
        return Err(Error::Shape(format!("{what}: {len} values are not whole [tokens, {n_heads}, {head_dim}] rows")));
    }
    Ok(len / row)
}

/// Checks a decode call: `bytes` must be exactly what `tokens` tokens encode to.
pub fn check_encoded(codec: &dyn BlockCodec, bytes: &[u8], out_len: usize) -> Result<usize> {
    let tokens = whole_rows(out_len, codec.n_heads(), codec.head_dim(), "decode")?;
    let want = codec.encoded_len(tokens);
    if bytes.len() != want {
        return Err(Error::Shape(format!(
            "decode: {tokens} tokens of {} need {want} bytes, got {}",
            codec.name(),
            bytes.len()
        )));
    }
    Ok(tokens)
}
