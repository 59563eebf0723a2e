//! Host side of `window.cu`: new positions into a cache's f16 rows (sink, then ring), keys and
//! values in one launch.

use cudarc::driver::{CudaFunction, CudaView, CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg};

use super::{dev_err, Gpu};
use crate::error::{Error, Result};

pub(super) const SOURCES: &[&str] = &[include_str!("window.cu")];

/// Which source rows go where (mirrors `PutMap` in `window.cu`): `t` rows per sequence from a
/// token-major `[tokens, heads, D]` source, sequence `b`'s from token `src0 + b·src_t`; the first
/// `n_sink` to sink rows `sink0..`, the rest to ring rows `sink_cap + (ring0 + i) mod ring_cap`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PutMap {
    /// Rows per sequence.
    pub t: i32,
    /// Source tokens between sequences.
    pub src_t: i32,
    /// First source token.
    pub src0: i32,
    /// Heads per token.
    pub heads: i32,
    /// Rows that go to the sink.
    pub n_sink: i32,
    /// First sink row written.
    pub sink0: i32,
    /// Sink rows reserved (where the ring starts).
    pub sink_cap: i32,
    /// Ring row the rest start at.
    pub ring0: i32,
    /// Ring rows reserved.
    pub ring_cap: i32,
}

// SAFETY: plain old data with the C layout the kernel declares.
unsafe impl DeviceRepr for PutMap {}

/// The row-writing kernel for one head_dim, compiled when made (a decode step appends a row per
/// layer: looking the kernel up per call rebuilt its define header and cache key each time).
pub struct PutRows {
    head_dim: usize,
    function: CudaFunction,
    ragged: CudaFunction,
}

impl PutRows {
    /// The kernel for `head_dim`, compiled now.
    pub fn new(gpu: &Gpu, head_dim: usize) -> Result<Self> {
        let defines = [("D", head_dim as i64)];
        Ok(Self {
            head_dim,
            function: gpu.kernel(SOURCES, "vq_window_put", &defines, 0)?,
            ragged: gpu.kernel(SOURCES, "vq_window_put_ragged", &defines, 0)?,
        })
    }

    /// Writes rows of `k`/`v` (f32 `[tokens, heads, head_dim]`, see [`PutMap`]) as f16 into `w`
    /// (keys `[streams, rows, head_dim]`, values the same `plane` elements further), `streams` a
    /// multiple of `map.heads`. One launch.
    #[allow(clippy::too_many_arguments)]
    pub fn launch(
        &self,
        gpu: &Gpu,
        k: &CudaView<f32>,
        v: &CudaView<f32>,
        streams: usize,
        w: &mut CudaViewMut<u16>,
        rows: usize,
        plane: usize,
        map: PutMap,
    ) -> Result<()> {
        let (t, head_dim) = (map.t.max(0) as usize, self.head_dim);
        if t == 0 {
            return Ok(());
        }
        let last_row = (map.sink0 + map.n_sink - 1).max(map.sink_cap + map.ring_cap - 1);
        let ok = map.n_sink >= 0
            && map.sink0 >= 0
            && map.ring_cap > 0
            && map.ring0 >= 0
            && (map.n_sink as usize >= t || map.sink_cap + map.ring_cap <= rows as i32)
            && (map.n_sink == 0 || map.sink0 + map.n_sink <= map.sink_cap)
            && map.src0 >= 0
            && map.heads > 0
            && streams.is_multiple_of(map.heads as usize)
            && t <= map.src_t as usize
            && k.len()
                >= (map.src0 as usize + (streams / map.heads as usize - 1) * map.src_t as usize + t)
                    * map.heads as usize
                    * head_dim
            && v.len() >= k.len()
            && plane >= streams * rows * head_dim
            && w.len() >= plane + streams * rows * head_dim;
        if !ok || last_row < 0 {
            return Err(Error::Shape(format!(
                "window put: {map:?} does not fit {streams} streams of {rows} rows × {head_dim}"
            )));
        }
        let cfg = LaunchConfig {
            grid_dim: (streams as u32, t as u32, 1),
            block_dim: (head_dim.min(256) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (plane, rows_i) = (plane as i64, rows as i32);
        let mut l = gpu.stream().launch_builder(&self.function);
        l.arg(k).arg(v).arg(w).arg(&plane).arg(&rows_i).arg(&map);
        // SAFETY: the arguments follow `vq_window_put`'s signature (k, v, w, plane, W, map) and
        // `PutMap`'s C layout; the checks above keep every source row and destination row of the
        // grid inside `k`, `v` and `w`.
        unsafe { l.launch(cfg) }.map_err(dev_err)?;
        Ok(())
    }

    /// One row of each sequence of a ragged batch in one launch: `host` holds 3 ints per sequence
    /// (slot, packed input row, destination row), `table` the same on the device; `k`/`v` are the
    /// step's packed rows `[tokens, heads, D]` f32, `w` every slot's rows (keys, then values
    /// `plane` apart, `rows` per stream).
    #[allow(clippy::too_many_arguments)]
    pub fn launch_ragged(
        &self,
        gpu: &Gpu,
        k: &CudaView<f32>,
        v: &CudaView<f32>,
        heads: usize,
        table: &CudaView<i32>,
        host: &[i32],
        w: &mut CudaViewMut<u16>,
        rows: usize,
        plane: usize,
    ) -> Result<()> {
        let d = self.head_dim;
        let seqs = host.len() / 3;
        let tokens = k.len().min(v.len()) / (heads * d).max(1);
        let slots = plane / (heads * rows * d).max(1);
        let entries_ok = host.chunks_exact(3).all(|e| {
            e.iter().all(|&x| x >= 0) && (e[0] as usize) < slots && (e[1] as usize) < tokens && (e[2] as usize) < rows
        });
        let ok = seqs > 0
            && host.len() == 3 * seqs
            && table.len() >= host.len()
            && heads > 0
            && entries_ok
            && w.len() >= 2 * plane
            && plane >= slots * heads * rows * d;
        if !ok {
            return Err(Error::Shape(format!(
                "ragged window put: {seqs} sequences do not fit {slots} slots of {rows} rows × {d} or {tokens} input rows"
            )));
        }
        let cfg = LaunchConfig {
            grid_dim: ((seqs * heads) as u32, 1, 1),
            block_dim: (d.min(256) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (plane_i, rows_i, heads_i) = (plane as i64, rows as i32, heads as i32);
        let mut l = gpu.stream().launch_builder(&self.ragged);
        l.arg(k).arg(v).arg(w).arg(&plane_i).arg(&rows_i).arg(&heads_i).arg(table);
        // SAFETY: the arguments follow `vq_window_put_ragged`'s signature (k, v, w, plane, W,
        // heads, table); every entry was checked above (slot, input row and destination row inside
        // their buffers), and the device table holds the same values as `host`.
        unsafe { l.launch(cfg) }.map_err(dev_err)?;
        Ok(())
    }
}
