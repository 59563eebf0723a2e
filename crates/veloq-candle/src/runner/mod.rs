//! Forward passes as a caller runs them: [`Forward`] is what generation, chunked prefill, chat and
//! the serving engine call; a [`Model`] runs every pass eagerly, a [`Runner`] beside it replays a
//! decode step from CUDA graphs where it can (the graphs and their buffers are the runner's, so the
//! model holds weights and tables only).

#[cfg(feature = "cuda")]
mod graph;

#[cfg(feature = "cuda")]
pub use graph::StepPhases;

use candle_core::Tensor;

use crate::cache::{ModelCache, Step};
use crate::cuda_options::CudaOptions;
use crate::error::{Error, Result};
use crate::model::{Logits, Model};

/// Something that runs a model's forward passes over caches.
pub trait Forward: Send + Sync {
    /// The model whose passes these are.
    fn model(&self) -> &Model;

    /// One step over `cache`'s slots ([`Model::forward_step`]).
    fn forward_step(&self, tokens: &[u32], step: &Step, cache: &mut ModelCache, logits: Logits) -> Result<Tensor>;

    /// `tokens` for the sequence in slot 0, continuing where its caches end.
    fn forward(&self, tokens: &[u32], cache: &mut ModelCache, logits: Logits) -> Result<Tensor> {
        if tokens.is_empty() {
            return Err(Error::Config("forward needs at least one token".into()));
        }
        let step = Step::single(0, cache.len(0), tokens.len())?;
        self.forward_step(tokens, &step, cache, logits)
    }
}

impl Forward for Model {
    fn model(&self) -> &Model {
        self
    }

    fn forward_step(&self, tokens: &[u32], step: &Step, cache: &mut ModelCache, logits: Logits) -> Result<Tensor> {
        Model::forward_step(self, tokens, step, cache, logits)
    }
}

/// A model with what running it fast on its device takes: on CUDA, decode steps replayed from
/// graphs (per batch size, captured on first use) when [`CudaOptions::graphs`] is on.
pub struct Runner {
    model: Model,
    #[cfg(feature = "cuda")]
    graphs: graph::Graphs,
}

impl Runner {
    /// Runs `model` with `options` (ignored off CUDA).
    pub fn new(model: Model, options: &CudaOptions) -> Self {
        #[cfg(not(feature = "cuda"))]
        let _ = options;
        Self {
            model,
            #[cfg(feature = "cuda")]
            graphs: graph::Graphs::new(options.graphs),
        }
    }

    /// Gives the model back.
    pub fn into_model(self) -> Model {
        self.model
    }

    /// Decode steps replayed from CUDA graphs from now on (`on`), or issued op by op.
    #[cfg(feature = "cuda")]
    pub fn set_cuda_graphs(&self, on: bool) {
        self.graphs.set(on)
    }

    /// CUDA graph launches issued so far (one per segment between attention calls).
    #[cfg(feature = "cuda")]
    pub fn cuda_graph_launches(&self) -> usize {
        self.graphs.launches()
    }

    /// Starts (sums from zero) or stops timing CUDA-graph decode steps part by part with CUDA
    /// events: the segments' products, rows in, attention, flushes (see [`StepPhases`]).
    #[cfg(feature = "cuda")]
    pub fn set_step_phases(&self, on: bool) {
        self.graphs.set_phases(on)
    }

    /// What timed graph steps spent in each part since [`set_step_phases`](Self::set_step_phases).
    #[cfg(feature = "cuda")]
    pub fn step_phases(&self) -> Option<StepPhases> {
        self.graphs.phases()
    }
}

impl Forward for Runner {
    fn model(&self) -> &Model {
        &self.model
    }

    fn forward_step(&self, tokens: &[u32], step: &Step, cache: &mut ModelCache, logits: Logits) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        {
            self.model.check_step(tokens, step, cache)?;
            self.graphs.note(&self.model, tokens.len())?;
            // Graphs run decode steps only, where every token is its sequence's last: `All` and
            // `Last` are the same logits.
            if let Some(out) = self.graphs.forward(&self.model, tokens, step, cache)? {
                return Ok(out);
            }
        }
        self.model.forward_step(tokens, step, cache, logits)
    }
}
