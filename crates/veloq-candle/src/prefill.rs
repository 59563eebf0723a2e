//! Chunked prefill: a long prompt goes through the model a chunk at a time, so the work per
//! forward pass (activations, attention tiles, the step's f16 rows) is bounded by the chunk, not
//! the prompt. Each chunk is appended to the caches, attends causally over everything before it
//! and is committed — the earlier chunks are codes while the later ones run, exactly as in decode.
//! Written once against [`ModelCache`], so every cache and backend serves it.

use candle_core::Tensor;

use crate::cache::{ModelCache, Step};
use crate::error::{Error, Result};
use crate::model::Logits;
use crate::runner::Forward;

/// llama.cpp's default micro-batch: large enough that the weight pass is a real matrix product,
/// small enough that a chunk's activations stay a few MiB.
pub const DEFAULT_CHUNK: usize = 512;

/// Feeds `tokens` to the sequence in `slot` after what it holds, `chunk` tokens per forward pass,
/// and returns the last token's logits `[vocab]`. `progress(done, total)` is called after every
/// chunk. On any error the slot is truncated back to where it was, so a refused prompt (over the
/// context, a bad token id) loses nothing already in the cache.
pub fn prefill(
    model: &dyn Forward,
    caches: &mut ModelCache,
    slot: usize,
    tokens: &[u32],
    chunk: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Tensor> {
    if tokens.is_empty() {
        return Err(Error::Config("prefill needs at least one token".into()));
    }
    if chunk == 0 {
        return Err(Error::Config("the prefill chunk must be at least one token".into()));
    }
    if slot >= caches.slots() {
        return Err(Error::Config(format!("slot {slot} of a cache with {} slots", caches.slots())));
    }
    let start = caches.len(slot);
    let requested = start + tokens.len();
    let max = model.model().max_context();
    if requested > max {
        return Err(Error::ContextOverflow { requested, max });
    }
    let mut run = |caches: &mut ModelCache| -> Result<Tensor> {
        let mut logits = None;
        for (i, part) in tokens.chunks(chunk).enumerate() {
            let step = Step::single(slot, start + i * chunk, part.len())?;
            logits = Some(model.forward_step(part, &step, caches, Logits::Last)?);
            progress(i * chunk + part.len(), tokens.len());
        }
        Ok(logits.expect("at least one chunk").squeeze(0)?)
    };
    run(caches).inspect_err(|_| {
        // Best effort: the error being reported matters more than a failure to roll back.
        let _ = caches.truncate(slot, start);
    })
}
