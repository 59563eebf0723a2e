//! Host side of `dense.cu`: decode attention over an f16 cache (flash-decoding: split over the
//! sequence, then a merge). The baseline the code kernels are measured against end to end, built
//! the same way so the comparison is kernel against kernel.

use std::sync::OnceLock;

use cudarc::driver::{CudaFunction, CudaView, CudaViewMut, LaunchConfig};

use super::attention::{AttentionScratch, Ragged};
use super::launch::Launch;
use super::{whole_words, Gpu};
use crate::error::{Error, Result};

pub(super) const SOURCES: &[&str] = &[include_str!("dense.cu")];
const THREADS: u32 = 256;
/// Most positions one split block scores (its weights sit in shared memory).
const MAX_SPLIT: usize = 2048;
/// Fewest positions per split.
const MIN_SPLIT: usize = 128;

/// Decode attention over f16 keys and values of one geometry.
pub struct GpuDenseAttention {
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// Compiled split and merge kernels, found once.
    prepared: OnceLock<(CudaFunction, CudaFunction)>,
}

impl GpuDenseAttention {
    /// head_dim a multiple of 64 up to 512; q_heads a multiple of kv_heads.
    pub fn new(q_heads: usize, kv_heads: usize, head_dim: usize) -> Result<Self> {
        if !head_dim.is_multiple_of(64) || head_dim > 512 || kv_heads == 0 || !q_heads.is_multiple_of(kv_heads) {
            return Err(Error::Device(format!("f16 decode attention takes head_dim a multiple of 64 up to 512 and grouped heads; got {q_heads}/{kv_heads}×{head_dim}")));
        }
        Ok(Self { q_heads, kv_heads, head_dim, prepared: OnceLock::new() })
    }

    fn group(&self) -> usize {
        self.q_heads / self.kv_heads
    }

    /// Splits for `batch` × `s` positions: at least 4 blocks per multiprocessor where the sequence
    /// allows (≥ 128 positions each), never more than 2048 positions per block.
    pub fn splits(&self, gpu: &Gpu, batch: usize, s: usize) -> usize {
        let streams = batch * self.kv_heads;
        let want = (4 * gpu.multiprocessors() as usize).div_ceil(streams);
        want.clamp(s.div_ceil(MAX_SPLIT).max(1), s.div_ceil(MIN_SPLIT).max(1))
    }

    /// Compiles the kernels now (they are otherwise compiled at the first call).
    pub fn prepare(&self, gpu: &Gpu) -> Result<()> {
        self.kernels(gpu).map(|_| ())
    }

    fn kernels(&self, gpu: &Gpu) -> Result<&(CudaFunction, CudaFunction)> {
        if let Some(k) = self.prepared.get() {
            return Ok(k);
        }
        let (g, d) = (self.group(), self.head_dim);
        // Compiled for the largest shared memory a launch can ask for.
        let smem = whole_words((g * MAX_SPLIT).max(THREADS as usize / (d / 8) * g * d) * 4);
        let split = gpu.kernel(SOURCES, "f16_attend_split", &self.defines(), smem)?;
        let merge = gpu.kernel(SOURCES, "f16_attend_merge", &self.defines(), 0)?;
        Ok(self.prepared.get_or_init(|| (split, merge)))
    }

    fn defines(&self) -> Vec<(&'static str, i64)> {
        vec![
            ("D", self.head_dim as i64),
            ("G", self.group() as i64),
            ("HKV", self.kv_heads as i64),
            ("HQ", self.q_heads as i64),
            ("THREADS", THREADS as i64),
        ]
    }

    /// `q` (`[batch, q_heads, D]` f32) over the first `s` positions of `k`/`v` (f16 bits,
    /// `[batch·kv_heads, stride, D]`), into `out` (`[batch, q_heads, D]`). Two launches.
    /// `fresh`: the launch right before this one in the stream wrote rows from this position on
    /// and nothing else the attention reads (a decode step's put), so splits before it run while
    /// it does (launch.rs); `None` makes no such promise.
    #[allow(clippy::too_many_arguments)]
    pub fn attend(
        &self,
        gpu: &Gpu,
        q: &CudaView<f32>,
        k: &CudaView<u16>,
        v: &CudaView<u16>,
        batch: usize,
        s: usize,
        stride: usize,
        scale: f32,
        fresh: Option<usize>,
        scratch: &mut AttentionScratch,
        out: &mut CudaViewMut<f32>,
    ) -> Result<()> {
        let streams = batch * self.kv_heads;
        if s == 0 || stride < s {
            return Err(Error::Device(format!("f16 attention over {s} positions with stride {stride}")));
        }
        let ok = q.len() >= batch * self.q_heads * self.head_dim
            && out.len() >= batch * self.q_heads * self.head_dim
            && k.len() >= streams * stride * self.head_dim
            && v.len() >= streams * stride * self.head_dim;
        if !ok {
            return Err(Error::Shape("f16 attention: a buffer is smaller than the shapes say".into()));
        }
        // 0: every block waits for the launch before it (nothing vouched for).
        let fresh = fresh.map_or(0, |f| f.min(s));
        self.launch(gpu, q, k, v, batch, s, stride, scale, fresh, None, scratch, out)
    }

    /// Decode attention of a ragged batch in two launches: sequences at different positions of
    /// the same storage, `seqs` ([`DENSE_RAGGED_INTS`] per sequence, [`dense_ragged_entry`]) giving
    /// each one's slot (streams `slot·kv_heads..`), query row of `q` and `out`, and length; `k`/`v`
    /// hold every slot (`[slots·kv_heads, stride, D]`). Splits are sized for the longest.
    #[allow(clippy::too_many_arguments)]
    pub fn attend_ragged(
        &self,
        gpu: &Gpu,
        q: &CudaView<f32>,
        k: &CudaView<u16>,
        v: &CudaView<u16>,
        seqs: &Ragged,
        stride: usize,
        scale: f32,
        scratch: &mut AttentionScratch,
        out: &mut CudaViewMut<f32>,
    ) -> Result<()> {
        let d = self.head_dim;
        let slots = k.len().min(v.len()) / (self.kv_heads * stride * d).max(1);
        let (q_rows, out_rows) = (q.len() / (self.q_heads * d), out.len() / (self.q_heads * d));
        let (mut batch, mut longest) = (0, 0);
        for (i, e) in seqs.sequences(DENSE_RAGGED_INTS)?.enumerate() {
            let (slot, row, len) = (e[0], e[1], e[2]);
            let fits = slot >= 0
                && (slot as usize) < slots
                && row >= 0
                && (row as usize) < q_rows.min(out_rows)
                && len > 0
                && len as usize <= stride;
            if !fits {
                return Err(Error::Shape(format!(
                    "ragged f16 batch, sequence {i}: slot {slot}, row {row}, length {len} outside {slots} slots, \
                     {q_rows} query rows, {stride} positions"
                )));
            }
            longest = longest.max(len as usize);
            batch += 1;
        }
        self.launch(gpu, q, k, v, batch, longest, stride, scale, 0, Some(&seqs.table), scratch, out)
    }

    /// Both launches, the buffers checked by the caller: `batch` sequences of (at most, with
    /// `seqs`) `s` positions.
    #[allow(clippy::too_many_arguments)]
    fn launch(
        &self,
        gpu: &Gpu,
        q: &CudaView<f32>,
        k: &CudaView<u16>,
        v: &CudaView<u16>,
        batch: usize,
        s: usize,
        stride: usize,
        scale: f32,
        fresh: usize,
        seqs: Option<&CudaView<i32>>,
        scratch: &mut AttentionScratch,
        out: &mut CudaViewMut<f32>,
    ) -> Result<()> {
        let (d, g) = (self.head_dim, self.group());
        let streams = batch * self.kv_heads;
        let nsplit = self.splits(gpu, batch, s);
        let split = s.div_ceil(nsplit);
        let parts = batch * self.q_heads * nsplit;
        if scratch.part_o.len() < parts * d || scratch.part_ml.len() < parts * 2 {
            return Err(Error::Shape("f16 attention: the scratch is smaller than the shapes say".into()));
        }
        let ngrp = THREADS as usize / (d / 8);
        let smem = whole_words((g * split).max(ngrp * g * d) * 4);
        let (split_fn, merge_fn) = self.kernels(gpu)?;
        let (s_i, stride_i, split_i, fresh_i) = (s as i32, stride as i64, split as i32, fresh as i32);
        // The table, or a null pointer (a uniform batch).
        let null = 0u64;
        let cfg = LaunchConfig {
            grid_dim: (nsplit as u32, streams as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let mut l = Launch::new(gpu.stream(), split_fn);
        l.buf(q)
            .buf(k)
            .buf(v)
            .buf_mut(&mut scratch.part_o)
            .buf_mut(&mut scratch.part_ml)
            .val(&s_i)
            .val(&stride_i)
            .val(&split_i)
            .val(&scale)
            .val(&fresh_i);
        match seqs {
            Some(t) => l.buf(t),
            None => l.val(&null),
        };
        // SAFETY: arguments in f16_attend_split's order (q, k, v, part_o, part_ml, S, stride,
        // split, scale, fresh, seqs); the callers' checks bound every stream's rows (every
        // table entry's slot, row and length) and every partial. Overlapped: a block whose rows
        // reach `fresh` (every block when it is 0) waits first.
        unsafe { l.run(cfg, gpu.overlaps()) }?;
        let cfg = LaunchConfig {
            grid_dim: (self.q_heads as u32, batch as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: whole_words(nsplit * 4) as u32,
        };
        let nsplit_i = nsplit as i32;
        let mut l = Launch::new(gpu.stream(), merge_fn);
        l.buf(&scratch.part_o).buf(&scratch.part_ml).buf_mut(out).val(&nsplit_i);
        match seqs {
            Some(t) => l.buf(t),
            None => l.val(&null),
        };
        // SAFETY: arguments in f16_attend_merge's order (part_o, part_ml, out, nsplit, seqs); one
        // block per (query head, sequence) reads its `nsplit` partials and writes its output row
        // (a checked table's row), after waiting for the split kernel.
        unsafe { l.run(cfg, gpu.overlaps()) }?;
        Ok(())
    }
}

/// Ints per sequence of a ragged f16 table: slot, query row, length.
pub const DENSE_RAGGED_INTS: usize = 3;

/// One sequence's entry of a ragged f16 table, in the order `f16_attend_split` reads it.
pub fn dense_ragged_entry(slot: usize, row: usize, len: usize) -> [i32; DENSE_RAGGED_INTS] {
    [slot as i32, row as i32, len as i32]
}

/// Defines of a few geometries, for the NVRTC compile check.
pub(super) fn example_defines() -> Vec<Vec<(&'static str, i64)>> {
    [(32, 8, 128), (9, 3, 64), (8, 4, 256)]
        .iter()
        .map(|&(hq, hkv, d)| GpuDenseAttention::new(hq, hkv, d).expect("valid").defines())
        .collect()
}
