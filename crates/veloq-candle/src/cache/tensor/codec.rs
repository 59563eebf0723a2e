//! The VecInfer codec in candle tensor ops only, so it runs on every candle device (CPU, CUDA,
//! Metal): what devices without fused kernels get. Memory stays bounded by chunking: the
//! nearest-centroid search is ‖c‖² − 2x·c through a matmul over chunks of rows, never an
//! [N, centroids, sub_dim] difference tensor.

use std::sync::Mutex;

use candle_core::{DType, Device, DeviceLocation, Tensor, D};

use veloq::codec::codebook::Granularity;
use veloq::codec::hadamard::Hadamard;
use veloq::codec::vecinfer::VecInferCodec;

use crate::error::Result;

/// Bytes of distance matrix one search chunk may hold.
const CHUNK_BYTES: usize = 64 << 20;

/// The (block-diagonal) Hadamard of size `d` as a symmetric `[d, d]` matrix on `dev`, made once
/// per device and size: every layer's codec shares it.
pub(crate) fn hadamard(d: usize, dev: &Device) -> Result<Tensor> {
    static MATRICES: Mutex<Vec<(DeviceLocation, usize, Tensor)>> = Mutex::new(Vec::new());
    let mut all = MATRICES.lock().expect("hadamard registry lock");
    if let Some((_, _, t)) = all.iter().find(|(l, n, _)| *l == dev.location() && *n == d) {
        return Ok(t.clone());
    }
    let had = Hadamard::new(d)?;
    let mut m = vec![0.0f32; d * d];
    for (i, row) in m.chunks_exact_mut(d).enumerate() {
        row[i] = 1.0;
        had.apply(row);
    }
    let t = Tensor::from_vec(m, (d, d), dev)?;
    all.push((dev.location(), d, t.clone()));
    Ok(t)
}

/// A VecInfer codec's tables as tensors on one device.
pub struct TensorCodec {
    /// Kv heads.
    pub heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Dimensions per sub-vector.
    pub sub_dim: usize,
    /// Centroids per codebook.
    pub centroids: usize,
    /// `[H, D]`, when the codec centers / smooths.
    pub mean: Option<Tensor>,
    /// `[H, D]` smoothing scales, when the codec smooths.
    pub scale: Option<Tensor>,
    inv_scale: Option<Tensor>,
    /// The (block-diagonal) Hadamard as a symmetric `[D, D]` matrix.
    rot: Option<Tensor>,
    /// `[B, K, sd]` and `[B, sd, K]`, B = 1 (per layer) or the sub-space count.
    books: Tensor,
    books_t: Tensor,
    /// `[B, 1, K]`.
    norms: Tensor,
}

impl TensorCodec {
    /// The tables of `codec` on `dev`.
    pub fn new(codec: &VecInferCodec, dev: &Device) -> Result<Self> {
        let (h, d) = (codec.n_heads(), codec.head_dim());
        let shape = codec.shape();
        let (k, sd) = (shape.centroids(), shape.sub_dim);
        let b = if codec.books().granularity() == Granularity::PerLayer { 1 } else { d / sd };
        let hd = |v: &[f32]| Tensor::from_slice(v, (h, d), dev);
        let rot = if codec.rotates() { Some(hadamard(d, dev)?) } else { None };
        let flat: Vec<f32> = codec.books().books().iter().flat_map(|bk| bk.centroids().iter().copied()).collect();
        let norms: Vec<f32> = codec.books().books().iter().flat_map(|bk| bk.norms().iter().copied()).collect();
        let books = Tensor::from_vec(flat, (b, k, sd), dev)?;
        Ok(Self {
            heads: h,
            head_dim: d,
            sub_dim: sd,
            centroids: k,
            mean: codec.mean().map(hd).transpose()?,
            scale: codec.smooth().map(|s| hd(s.as_slice())).transpose()?,
            inv_scale: codec
                .smooth()
                .map(|s| hd(&s.as_slice().iter().map(|x| 1.0 / x).collect::<Vec<_>>()))
                .transpose()?,
            rot,
            books_t: books.transpose(1, 2)?.contiguous()?,
            books,
            norms: Tensor::from_vec(norms, (b, 1, k), dev)?,
        })
    }

    /// Sub-vectors per head vector.
    pub fn subspaces(&self) -> usize {
        self.head_dim / self.sub_dim
    }

    /// Codes are stored as u8 when they fit (≤ 256 centroids), else u32.
    pub fn code_dtype(&self) -> DType {
        if self.centroids <= 256 {
            DType::U8
        } else {
            DType::U32
        }
    }

    /// `[T, H, D]` → codes `[T, H, M]`: center, smooth, rotate, chunked nearest-centroid search.
    pub fn quantize(&self, x: &Tensor) -> Result<Tensor> {
        let (t, h, d) = x.dims3()?;
        let mut y = x.to_dtype(DType::F32)?;
        if let Some(m) = &self.mean {
            y = y.broadcast_sub(m)?;
        }
        if let Some(s) = &self.inv_scale {
            y = y.broadcast_mul(s)?;
        }
        let mut y = y.reshape((t * h, d))?;
        if let Some(r) = &self.rot {
            y = y.matmul(r)?;
        }
        let (m, sd, n) = (self.subspaces(), self.sub_dim, t * h);
        let y = y.reshape((n, m, sd))?.transpose(0, 1)?.contiguous()?; // [M, N, sd]
        let rows = (CHUNK_BYTES / (m * self.centroids * 4)).max(1);
        let mut parts = Vec::with_capacity(n.div_ceil(rows));
        for n0 in (0..n).step_by(rows) {
            let len = rows.min(n - n0);
            let xc = y.narrow(1, n0, len)?;
            let dist = self.norms.broadcast_sub(&(xc.broadcast_matmul(&self.books_t)? * 2.0)?)?; // [M, len, K]
            parts.push(dist.argmin(D::Minus1)?);
        }
        let codes = Tensor::cat(&parts, 1)?.t()?.contiguous()?.reshape((t, h, m))?;
        Ok(codes.to_dtype(self.code_dtype())?)
    }

    /// Centroid rows of `codes` (`[..., M]`) as `[rows, M, sd]` in code space.
    pub(crate) fn centroid_rows(&self, codes: &Tensor) -> Result<Tensor> {
        let m = self.subspaces();
        let flat = codes.to_dtype(DType::U32)?.flatten_all()?;
        let rows = flat.dim(0)? / m;
        let idx = if self.books.dim(0)? == 1 {
            flat
        } else {
            let offs = Tensor::arange(0u32, m as u32, codes.device())?.affine(self.centroids as f64, 0.0)?;
            flat.reshape((rows, m))?.broadcast_add(&offs)?.flatten_all()?
        };
        let table = self.books.reshape(((), self.sub_dim))?;
        Ok(table.index_select(&idx, 0)?.reshape((rows, m, self.sub_dim))?)
    }

    /// Codes `[T, H, M]` → `[T, H, D]` f32 (prefill and truncation only; decode never rebuilds).
    pub fn decode(&self, codes: &Tensor) -> Result<Tensor> {
        let (t, h, _) = codes.dims3()?;
        let mut y = self.centroid_rows(codes)?.reshape((t * h, self.head_dim))?;
        if let Some(r) = &self.rot {
            y = y.matmul(r)?;
        }
        let mut y = y.reshape((t, h, self.head_dim))?;
        if let Some(s) = &self.scale {
            y = y.broadcast_mul(s)?;
        }
        if let Some(m) = &self.mean {
            y = y.broadcast_add(m)?;
        }
        Ok(y)
    }

    /// Lookup tables for queries already moved to code space: `qt` `[R, D]` → `[R, M, K]`.
    pub fn lookup_tables(&self, qt: &Tensor) -> Result<Tensor> {
        let r = qt.dim(0)?;
        let (m, sd) = (self.subspaces(), self.sub_dim);
        let q = qt.reshape((r, m, sd))?;
        if self.books.dim(0)? == 1 {
            let bt = self.books_t.squeeze(0)?; // [sd, K]
            Ok(q.reshape((r * m, sd))?.matmul(&bt)?.reshape((r, m, self.centroids))?)
        } else {
            let q = q.transpose(0, 1)?.contiguous()?; // [M, R, sd]
            Ok(q.matmul(&self.books_t)?.transpose(0, 1)?.contiguous()?) // [R, M, K]
        }
    }

    /// Per-centroid weight sums `w` `[R, M, K]` → code-space vectors `[R, D]`.
    pub fn decode_sums(&self, w: &Tensor) -> Result<Tensor> {
        let (r, m, _) = w.dims3()?;
        if self.books.dim(0)? == 1 {
            let b = self.books.squeeze(0)?; // [K, sd]
            Ok(w.reshape((r * m, self.centroids))?.matmul(&b)?.reshape((r, self.head_dim))?)
        } else {
            let w = w.transpose(0, 1)?.contiguous()?; // [M, R, K]
            Ok(w.matmul(&self.books)?.transpose(0, 1)?.contiguous()?.reshape((r, self.head_dim))?)
        }
    }

    /// Bytes of the tables on the device.
    pub fn resident_bytes(&self) -> usize {
        let n = |t: &Option<Tensor>| t.as_ref().map_or(0, |t| t.elem_count() * 4);
        // The rotation matrix is shared by every codec of its size on the device: not counted here.
        n(&self.mean)
            + n(&self.scale)
            + n(&self.inv_scale)
            + (2 * self.books.elem_count() + self.norms.elem_count()) * 4
    }

    /// The Hadamard rotation (its own inverse) applied to rows `[R, D]`.
    pub fn rotate(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match &self.rot {
            Some(r) => x.matmul(r)?,
            None => x.clone(),
        })
    }
}
