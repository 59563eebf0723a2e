//! The one cache type: a layer's keys and values for several sequences, kept where the
//! [`Residency`] policy says and stored and attended by a [`Backend`]. Coded methods (VecInfer,
//! KIVI, Lloyd–Max) and dense ones (fp16, sliding windows) differ only in their policy and in
//! whether the backend holds codecs.

use candle_core::Tensor;

use super::backend::{Backend, Heads};
use super::residency::{Move, Policy, Residency, SeqView};
use super::step::Step;
use super::LayerCache;
use crate::error::{Error, Result};

/// One layer's keys and values for `slots` sequences: a [`Residency`] executed by backend `B`.
pub struct KvCache<B: Backend> {
    residency: Residency,
    backend: B,
    heads: Heads,
    /// The appended step's keys and values, until its commit.
    input: Option<B::Input>,
}

impl<B: Backend> KvCache<B> {
    /// A cache kept by `policy` for `slots` sequences of `heads`, stored by `backend`.
    pub fn new(policy: Policy, slots: usize, heads: Heads, backend: B) -> Result<Self> {
        if heads.kv == 0 || !heads.q.is_multiple_of(heads.kv) || heads.dim == 0 {
            return Err(Error::Shape(format!("{} query heads over {} kv heads of {}", heads.q, heads.kv, heads.dim)));
        }
        Ok(Self { residency: Residency::new(policy, slots)?, backend, heads, input: None })
    }

    /// The backend (its storage, for inspection and benchmarks).
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Where each sequence's positions live.
    pub fn residency(&self) -> &Residency {
        &self.residency
    }

    fn check(&self, what: &str, x: &Tensor, rows: usize, heads: usize) -> Result<()> {
        match x.dims3() {
            Ok(d) if d == (rows, heads, self.heads.dim) => Ok(()),
            _ => Err(Error::Shape(format!(
                "{what} {:?}: the step needs [{rows}, {heads}, {}]",
                x.dims(),
                self.heads.dim
            ))),
        }
    }

    /// What attention over the appended step reads: the sequences' views and the step's input.
    fn attention_inputs(&self, q: &Tensor, step: &Step) -> Result<(Vec<SeqView>, &B::Input)> {
        self.check("queries", q, step.tokens(), self.heads.q)?;
        let views = self.residency.views(step)?;
        let input = self.input.as_ref().ok_or_else(|| Error::Config("attend before append".into()))?;
        Ok((views, input))
    }

    fn run(&mut self, moves: Vec<Move>) -> Result<()> {
        // Consecutive moves of one kind go to the backend together (it may batch them).
        let mut rest = &moves[..];
        while let Some(first) = rest.first() {
            let n = rest.iter().take_while(|m| std::mem::discriminant(*m) == std::mem::discriminant(first)).count();
            let (run, tail) = rest.split_at(n);
            rest = tail;
            if let Move::Restore(_) | Move::Release { .. } = first {
                for m in run {
                    match *m {
                        Move::Restore(ref r) => self.backend.restore(r)?,
                        Move::Release { slot, rows } => self.backend.release(slot, rows)?,
                        _ => {}
                    }
                }
                continue;
            }
            // Puts and codes come only from a commit, which the step's input outlives.
            let input = self.input.as_ref().ok_or_else(|| Error::Config("rows to store but no step input".into()))?;
            match first {
                Move::Put(_) => {
                    let puts: Vec<_> =
                        run.iter().filter_map(|m| if let Move::Put(p) = m { Some(*p) } else { None }).collect();
                    self.backend.put_rows(input, &puts)?;
                }
                _ => {
                    let spans: Vec<_> =
                        run.iter().filter_map(|m| if let Move::Quantize(q) = m { Some(*q) } else { None }).collect();
                    self.backend.quantize(input, &spans)?;
                }
            }
        }
        Ok(())
    }
}

impl<B: Backend> LayerCache for KvCache<B> {
    fn append(&mut self, k: &Tensor, v: &Tensor, step: &Step) -> Result<()> {
        self.check("keys", k, step.tokens(), self.heads.kv)?;
        self.check("values", v, step.tokens(), self.heads.kv)?;
        let input = self.backend.input(k, v)?;
        let puts = self.residency.append(step)?;
        self.input = Some(input);
        self.backend.put_rows(self.input.as_ref().expect("just set"), &puts)
    }

    fn attend(&self, q: &Tensor, step: &Step, scale: f32) -> Result<Tensor> {
        let (views, input) = self.attention_inputs(q, step)?;
        self.backend.attend(q, &views, input, scale)
    }

    fn attend_into(&self, q: &Tensor, step: &Step, scale: f32, out: &Tensor) -> Result<()> {
        let (views, input) = self.attention_inputs(q, step)?;
        self.backend.attend_into(q, &views, input, scale, out)
    }

    fn commit(&mut self) -> Result<()> {
        let moves = self.residency.commit();
        let r = self.run(moves);
        self.input = None;
        r
    }

    fn slots(&self) -> usize {
        self.residency.slots()
    }

    fn len(&self, slot: usize) -> usize {
        self.residency.len(slot)
    }

    fn truncate(&mut self, slot: usize, len: usize) -> Result<()> {
        let moves = self.residency.truncate(slot, len)?;
        self.run(moves)
    }

    fn fork(&mut self, from: usize, to: usize) -> Result<()> {
        let mut planned = self.residency.clone();
        let held = planned.fork(from, to)?;
        self.backend.copy_slot(from, to, held)?;
        self.residency = planned;
        Ok(())
    }

    fn resident_bytes(&self) -> usize {
        self.backend.resident_bytes()
    }

    fn sequence_bytes(&self, positions: usize) -> usize {
        self.backend.sequence_bytes(self.residency.policy().footprint(positions))
    }

    fn shared_bytes(&self, slot: usize) -> usize {
        self.backend.shared_bytes(slot)
    }

    fn fork_shares(&self, positions: usize) -> usize {
        self.backend.shareable_bytes(self.residency.policy().footprint(positions))
    }
}
