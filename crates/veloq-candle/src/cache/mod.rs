#![warn(missing_docs)]
//! The cache contract and its one implementation.
//!
//! A model layer hands its post-RoPE keys and values to a [`LayerCache`] and asks it for
//! attention, so a compressed cache scores against codes without rebuilding fp16 keys. Every
//! call names its [`Step`]: which sequences (slots), at which positions, with how many new tokens,
//! so sequences at different positions share a forward pass. `attend` reads only; `commit` moves
//! what the step left in f16 rows into codes.
//!
//! Layers of the design, each in its own file:
//! - [`step`]: what a forward pass runs (ragged sequences, packed tokens);
//! - [`residency`]: where every position lives (sink, codes, f16 ring, the step's own rows) —
//!   the storage policy, written once, device-free;
//! - [`backend`]: what a device provides (put rows, quantize spans, attend over codes, attend over
//!   rows with a mask, merge partials); [`cpu`] (veloq's CPU kernels), [`tensor`] (candle ops on
//!   any device) and, with the `cuda` feature, [`cuda`] (veloq's CUDA kernels over the tensor
//!   backend's storage);
//! - [`kv`]: [`KvCache`], the one cache type, a residency executed by a backend.
//!
//! Shapes: keys and values `[tokens, kv heads, head_dim]`, queries `[tokens, q heads, head_dim]`,
//! tokens packed sequence after sequence in step order; outputs f32 like the queries. GQA is
//! handled inside (query heads index their kv head; keys are never copied per query head).

pub mod backend;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod kv;
pub mod residency;
pub mod step;
pub mod tensor;

pub use backend::{Backend, Heads};
pub use cpu::CpuBackend;
#[cfg(feature = "cuda")]
pub use cuda::{CudaBackend, CudaRuntime};
pub use kv::KvCache;
pub use residency::{Footprint, Policy, Residency};
pub use step::{SeqStep, Step};
pub use tensor::TensorBackend;

use candle_core::Tensor;

use crate::error::{Error, Result};

/// One layer's keys and values for one or more sequences (slots), and attention over them. What a
/// model layer sees; [`KvCache`] over any backend implements it.
pub trait LayerCache: Send {
    /// Appends the step's new keys and values (`[tokens, kv heads, head_dim]`, packed in step
    /// order). Every sequence must continue where its slot ends; a refused step changes nothing.
    fn append(&mut self, k: &Tensor, v: &Tensor, step: &Step) -> Result<()>;
    /// Causal attention of the step's queries (`[tokens, q heads, head_dim]`) over everything
    /// their sequences hold: query `i` of a sequence starting at `start` sees positions
    /// `..=start + i` (on sliding-window layers, only the window's). Changes nothing.
    fn attend(&self, q: &Tensor, step: &Step, scale: f32) -> Result<Tensor>;
    /// [`attend`](Self::attend) written into `out` (`[tokens, q heads, head_dim]` f32,
    /// contiguous): a replayed CUDA graph reads attention from a buffer that never moves, and a
    /// backend with a fused decode kernel writes it there directly instead of through a copy.
    fn attend_into(&self, q: &Tensor, step: &Step, scale: f32, out: &Tensor) -> Result<()> {
        copy_into(out, &self.attend(q, step, scale)?)
    }
    /// Settles the appended step: rows beyond the recent window become codes. Call after attend.
    fn commit(&mut self) -> Result<()>;
    /// Sequence slots.
    fn slots(&self) -> usize;
    /// Positions the sequence in `slot` holds.
    fn len(&self, slot: usize) -> usize;
    /// Keeps the first `len` positions of `slot` (0 frees it for a new sequence).
    fn truncate(&mut self, slot: usize, len: usize) -> Result<()>;
    /// Makes the empty slot `to` hold what `from` holds (a copy, or storage shared where it
    /// never changes: [`shared_bytes`](Self::shared_bytes)): sequences that share a prompt
    /// prefill it once, then go their own ways. Call after commit. Caches that cannot copy their
    /// storage refuse, and the caller prefills instead.
    fn fork(&mut self, from: usize, to: usize) -> Result<()> {
        Err(Error::Config(format!("this cache cannot fork slot {from} into {to}")))
    }
    /// Bytes really held (rows, codes and the codecs' tables as allocated, storage that forks
    /// share counted once), not bit counts.
    fn resident_bytes(&self) -> usize;
    /// Bytes of `slot`'s storage that other slots hold too (after a fork, on caches that share
    /// what never changes instead of copying it); 0 where forks copy.
    fn shared_bytes(&self, slot: usize) -> usize {
        let _ = slot;
        0
    }
    /// Bytes a fork of a sequence's first `positions` positions shares with it: what
    /// [`shared_bytes`](Self::shared_bytes) reports on the fork, known before it is made (what
    /// admission can count once ahead of it).
    fn fork_shares(&self, positions: usize) -> usize {
        let _ = positions;
        0
    }
    /// Bytes the storage of one sequence of `positions` positions takes (grown from empty, its
    /// steps committed), the tables every sequence shares not counted: what admission control
    /// budgets per request. Device backends reserve every slot up front, so theirs is the slot's
    /// reservation whatever the length.
    fn sequence_bytes(&self, positions: usize) -> usize;
}

/// Copies an attention output into the buffer an `attend_into` names (same shape).
pub(crate) fn copy_into(out: &Tensor, y: &Tensor) -> Result<()> {
    if out.dims() != y.dims() {
        return Err(Error::Shape(format!("attention output {:?} into a buffer of {:?}", y.dims(), out.dims())));
    }
    Ok(out.slice_set(&y.contiguous()?, 0, 0)?)
}

/// Every layer's cache of one model, for the same sequence slots.
pub struct ModelCache {
    layers: Vec<Box<dyn LayerCache>>,
}

impl ModelCache {
    /// Every layer's cache, in layer order (all with the same slots).
    pub fn new(layers: Vec<Box<dyn LayerCache>>) -> Result<Self> {
        let slots = layers.first().map_or(0, |l| l.slots());
        if layers.is_empty() || layers.iter().any(|l| l.slots() != slots) {
            return Err(Error::Shape("a model cache needs layers with the same sequence slots".into()));
        }
        Ok(Self { layers })
    }

    /// The layers' caches.
    pub fn layers(&self) -> &[Box<dyn LayerCache>] {
        &self.layers
    }

    /// The layers' caches, to run a step on.
    pub fn layers_mut(&mut self) -> &mut [Box<dyn LayerCache>] {
        &mut self.layers
    }

    /// The layers' caches, to wrap or rebuild.
    pub fn into_layers(self) -> Vec<Box<dyn LayerCache>> {
        self.layers
    }

    /// Sequence slots of every layer.
    pub fn slots(&self) -> usize {
        self.layers[0].slots()
    }

    /// Positions the sequence in `slot` holds (every layer holds the same).
    pub fn len(&self, slot: usize) -> usize {
        self.layers[0].len(slot)
    }

    /// Whether `slot` holds nothing.
    pub fn is_empty(&self, slot: usize) -> bool {
        self.len(slot) == 0
    }

    /// Keeps the first `len` positions of `slot` in every layer.
    pub fn truncate(&mut self, slot: usize, len: usize) -> Result<()> {
        self.layers.iter_mut().try_for_each(|l| l.truncate(slot, len))
    }

    /// Makes the empty slot `to` hold the first `len` positions `from` holds, in every layer (a
    /// copy, then a cut where `from` holds more); on failure — a cache that cannot copy, a
    /// sliding window that cannot cut back that far — `to` is emptied again.
    pub fn fork(&mut self, from: usize, to: usize, len: usize) -> Result<()> {
        let mut r = self.layers.iter_mut().try_for_each(|l| l.fork(from, to));
        if r.is_ok() && self.len(to) > len {
            r = self.truncate(to, len);
        }
        if r.is_err() {
            self.truncate(to, 0)?;
        }
        r
    }

    /// Bytes every layer holds.
    pub fn resident_bytes(&self) -> usize {
        self.layers.iter().map(|l| l.resident_bytes()).sum()
    }

    /// Bytes of `slot`'s storage other slots hold too, in every layer (see
    /// [`LayerCache::shared_bytes`]).
    pub fn shared_bytes(&self, slot: usize) -> usize {
        self.layers.iter().map(|l| l.shared_bytes(slot)).sum()
    }

    /// Bytes a fork of `positions` positions shares with its source, in every layer (see
    /// [`LayerCache::fork_shares`]).
    pub fn fork_shares(&self, positions: usize) -> usize {
        self.layers.iter().map(|l| l.fork_shares(positions)).sum()
    }

    /// Bytes one sequence of `positions` positions takes in every layer (see
    /// [`LayerCache::sequence_bytes`]).
    pub fn sequence_bytes(&self, positions: usize) -> usize {
        self.layers.iter().map(|l| l.sequence_bytes(positions)).sum()
    }
}
