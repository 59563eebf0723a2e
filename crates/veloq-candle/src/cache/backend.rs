//! The seam between the caches and the devices: what a backend provides so that one cache type
//! serves every device. A backend owns one layer's storage (f16 rows and, for coded methods,
//! codes) for every sequence slot; it executes the moves a [`Residency`](super::Residency) plans
//! and attends over the views it describes, and never decides where a position lives.
//!
//! Attention is three pieces — codes (no mask: they are older than every query), f16 rows (causal
//! or sliding mask), and the merge of their softmax partials — composed by [`Backend::attend`].
//! Backends with a fused path (the CPU's one pass per head, CUDA's one-launch decode kernel)
//! override `attend` and keep the pieces for everything else.

use candle_core::Tensor;

use veloq::codec::block::BlockCodec;

use super::residency::{Footprint, Put, Quantize, Restore, SeqView};
use crate::error::{Error, Result};

/// Query heads, kv heads and head_dim of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Heads {
    /// Query heads.
    pub q: usize,
    /// Key/value heads.
    pub kv: usize,
    /// Head dimension.
    pub dim: usize,
}

impl Heads {
    /// Query heads per kv head.
    pub fn group(&self) -> usize {
        self.q / self.kv
    }

    /// Checks that `codec` codes head vectors of this layer (its kv heads and head_dim).
    pub fn check_codec(&self, codec: &dyn BlockCodec) -> Result<()> {
        if (codec.n_heads(), codec.head_dim()) != (self.kv, self.dim) {
            return Err(Error::Shape(format!(
                "codec {} is for {}×{}, the layer has {}×{}",
                codec.name(),
                codec.n_heads(),
                codec.head_dim(),
                self.kv,
                self.dim
            )));
        }
        Ok(())
    }
}

/// Storage and attention kernels of one layer's cache on one kind of device.
pub trait Backend: Send + Sync {
    /// A step's keys and values as this backend holds them from append to commit.
    type Input: Send + Sync;
    /// Softmax partials of a step's queries: per query head its maximum score, the sum of its
    /// weights and its weighted value sum.
    type Partial;

    /// The step's keys and values, `[tokens, kv heads, head_dim]` packed in step order.
    fn input(&self, k: &Tensor, v: &Tensor) -> Result<Self::Input>;
    /// Copies input rows into f16 rows, in order.
    fn put_rows(&mut self, input: &Self::Input, puts: &[Put]) -> Result<()>;
    /// Codes spans of ring rows (then rows of the step's input), in order.
    fn quantize(&mut self, input: &Self::Input, spans: &[Quantize]) -> Result<()>;
    /// Decodes codes back into rows and drops codes (a truncation into the coded span).
    fn restore(&mut self, restore: &Restore) -> Result<()>;

    /// Partials of the queries (`[tokens, q heads, head_dim]`, packed) over each view's codes.
    fn attend_codes(&self, q: &Tensor, views: &[SeqView], scale: f32) -> Result<Self::Partial>;
    /// Partials of the queries over each view's f16 rows and the step's own rows, masked.
    fn attend_rows(&self, q: &Tensor, views: &[SeqView], input: &Self::Input, scale: f32) -> Result<Self::Partial>;
    /// The partial of the union of what `a` and `b` attended (log-sum-exp rule).
    fn merge(&self, a: Self::Partial, b: Self::Partial) -> Result<Self::Partial>;
    /// Normalised outputs `[tokens, q heads, head_dim]` f32.
    fn finish(&self, p: Self::Partial) -> Result<Tensor>;

    /// Causal attention of the step's queries over everything their sequences hold.
    fn attend(&self, q: &Tensor, views: &[SeqView], input: &Self::Input, scale: f32) -> Result<Tensor> {
        compose(self, q, views, input, scale)
    }

    /// [`attend`](Self::attend) into `out` (`[tokens, q heads, head_dim]` f32, contiguous):
    /// backends whose kernels can write there directly override it.
    fn attend_into(&self, q: &Tensor, views: &[SeqView], input: &Self::Input, scale: f32, out: &Tensor) -> Result<()> {
        super::copy_into(out, &self.attend(q, views, input, scale)?)
    }

    /// Bytes really held: rows and codes as allocated, and the codecs' tables.
    fn resident_bytes(&self) -> usize;

    /// Bytes one sequence's storage takes when it holds `footprint`, the shared tables not
    /// counted: what it allocates (backends that grow with the sequence), or its slot's share of
    /// what was reserved up front (device backends), whatever the footprint.
    fn sequence_bytes(&self, footprint: Footprint) -> usize;

    /// Bytes of `slot`'s storage that other slots hold too (a fork shares its source's immutable
    /// blocks where the backend can): counted once in [`resident_bytes`](Self::resident_bytes).
    /// Backends that copy on fork share nothing (the default).
    fn shared_bytes(&self, slot: usize) -> usize {
        let _ = slot;
        0
    }

    /// Bytes of a slot holding `footprint` that a fork of it would share instead of copying:
    /// what [`shared_bytes`](Self::shared_bytes) reports on such a fork. 0 where forks copy.
    fn shareable_bytes(&self, footprint: Footprint) -> usize {
        let _ = footprint;
        0
    }

    /// Makes slot `to`, whose storage is unused, hold what slot `from` stores — its first
    /// `held.rows` rows and `held.coded` codes, copied or shared where they never change (a fork
    /// planned by [`Residency::fork`](super::Residency::fork)).
    fn copy_slot(&mut self, from: usize, to: usize, held: Footprint) -> Result<()>;

    /// Storage rows of `slot` from `rows` on are unused: backends that grow with their sequences
    /// free them; those that reserve up front keep them (the default).
    fn release(&mut self, slot: usize, rows: usize) -> Result<()> {
        let _ = (slot, rows);
        Ok(())
    }
}

/// Attention from the pieces: rows, codes where there are any, merged and normalised. The default
/// [`Backend::attend`], callable by a backend that overrides it for the views it has a faster
/// path for.
pub fn compose<B: Backend + ?Sized>(
    b: &B,
    q: &Tensor,
    views: &[SeqView],
    input: &B::Input,
    scale: f32,
) -> Result<Tensor> {
    let rows = b.attend_rows(q, views, input, scale)?;
    if views.iter().all(|v| v.coded == 0) {
        return b.finish(rows);
    }
    let codes = b.attend_codes(q, views, scale)?;
    b.finish(b.merge(codes, rows)?)
}
