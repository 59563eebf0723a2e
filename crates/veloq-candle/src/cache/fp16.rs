//! The fp16 baseline: keys and values as f16 in preallocated blocks of positions, so appending a
//! token never copies what is cached (no O(n) concatenation per token).

use candle_core::Tensor;
use half::f16;
use rayon::prelude::*;

use super::dense::{attend_dense, axpy, dot, output, query_rows, softmax, widen};
use super::{kv_rows, LayerCache};
use crate::error::{Error, Result};

/// Positions per block.
const BLOCK: usize = 256;

pub struct Fp16Cache {
    n_kv: usize,
    head_dim: usize,
    len: usize,
    keys: Vec<Box<[f16]>>,
    values: Vec<Box<[f16]>>,
}

impl Fp16Cache {
    pub fn new(n_kv: usize, head_dim: usize) -> Self {
        Self { n_kv, head_dim, len: 0, keys: Vec::new(), values: Vec::new() }
    }

    fn row(&self) -> usize {
        self.n_kv * self.head_dim
    }

    /// Keys or values of position `t`, all heads: `[n_kv, head_dim]`.
    fn at<'a>(&self, blocks: &'a [Box<[f16]>], t: usize) -> &'a [f16] {
        let r = self.row();
        &blocks[t / BLOCK][(t % BLOCK) * r..(t % BLOCK + 1) * r]
    }

    fn widen_all(&self, blocks: &[Box<[f16]>]) -> Vec<f32> {
        let mut out = vec![0.0f32; self.len * self.row()];
        for (t, o) in out.chunks_exact_mut(self.row()).enumerate() {
            widen(self.at(blocks, t), o);
        }
        out
    }
}

impl LayerCache for Fp16Cache {
    fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        let (t, kr, vr) = kv_rows(k, v, self.n_kv, self.head_dim, "fp16 cache")?;
        let r = self.row();
        for i in 0..t {
            let pos = self.len + i;
            if pos / BLOCK == self.keys.len() {
                self.keys.push(vec![f16::ZERO; BLOCK * r].into_boxed_slice());
                self.values.push(vec![f16::ZERO; BLOCK * r].into_boxed_slice());
            }
            let (b, o) = (pos / BLOCK, (pos % BLOCK) * r);
            for (dst, src) in [(&mut self.keys[b], &kr), (&mut self.values[b], &vr)] {
                dst[o..o + r].iter_mut().zip(&src[i * r..(i + 1) * r]).for_each(|(a, &x)| *a = f16::from_f32(x));
            }
        }
        self.len += t;
        Ok(())
    }

    fn attend(&mut self, q: &Tensor, scale: f64) -> Result<Tensor> {
        let (_, hq, t, d) = q.dims4()?;
        if t > 1 {
            return attend_dense(q, self.widen_all(&self.keys), self.widen_all(&self.values), self.n_kv, scale);
        }
        let qr = query_rows(q)?;
        let g = hq / self.n_kv;
        let s = self.len;
        let mut out = vec![0.0f32; hq * d];
        out.par_chunks_mut(d).enumerate().for_each(|(qh, o)| {
            let h = qh / g;
            let qv: Vec<f32> = qr[qh * d..(qh + 1) * d].iter().map(|x| x * scale as f32).collect();
            let mut buf = vec![0.0f32; d];
            let mut p = vec![0.0f32; s];
            for (tpos, pv) in p.iter_mut().enumerate() {
                widen(&self.at(&self.keys, tpos)[h * d..(h + 1) * d], &mut buf);
                *pv = dot(&qv, &buf);
            }
            softmax(&mut p);
            for (tpos, &pv) in p.iter().enumerate() {
                widen(&self.at(&self.values, tpos)[h * d..(h + 1) * d], &mut buf);
                axpy(pv, &buf, o);
            }
        });
        output(out, hq, d, q.device())
    }

    fn len(&self) -> usize {
        self.len
    }

    fn resident_bytes(&self) -> usize {
        (self.keys.len() + self.values.len()) * BLOCK * self.row() * 2
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        if len > self.len {
            return Err(Error::Config(format!("truncate to {len} beyond the {} cached positions", self.len)));
        }
        self.len = len;
        let blocks = len.div_ceil(BLOCK);
        self.keys.truncate(blocks);
        self.values.truncate(blocks);
        Ok(())
    }
}
