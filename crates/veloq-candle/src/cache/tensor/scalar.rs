//! The scalar baselines (KIVI, rotation + Lloyd–Max) in candle tensor ops, so that their caches
//! live and attend on any device (a GPU has no veloq kernels for them). The rules are the
//! codecs' own ([`ScalarForm`]), computed in the same f32 steps, so the decoded rows match the
//! CPU codec's. Storage is packed as tightly as the CPU codec's bytes: `bits` bit-planes of 8
//! elements per byte, and the f16 metadata (min and step per group, or the rms per row).

use candle_core::{DType, Device, Tensor, D};

use veloq::codec::block::{BlockCodec, ScalarForm};
use veloq::codec::kivi::KiviAxis;

use super::codec::hadamard;
use crate::error::{Error, Result};

/// How a codec's metadata groups positions.
#[derive(Clone, Debug)]
enum Rule {
    /// Groups of `group` tokens per channel (KIVI keys): metadata `[rows/group, 2, D]`.
    PerChannel { group: usize },
    /// Groups of `group` channels per token (KIVI values): metadata `[rows, 2, D/group]`.
    PerToken { group: usize },
    /// One rms per row after the rotation (Lloyd–Max): metadata `[rows, 1, 1]`.
    LloydMax { signs: Tensor, rot: Tensor, levels: Tensor, bounds: Tensor },
}

/// One scalar codec's tables on a device, and its encode/decode in tensor ops over `[kv, n, D]`.
#[derive(Clone, Debug)]
pub struct ScalarCodec {
    bits: usize,
    dim: usize,
    rule: Rule,
    /// `[b + 1]`: 2⁻ᵏ, to split codes into bits (exact in f32).
    halves: Tensor,
    /// `[9]`: 2⁻ᵏ, to split bytes into bits.
    byte_halves: Tensor,
    /// `[b, 1]` and `[8]`: 2ᵏ, to gather bits back.
    plane_weights: Tensor,
    byte_weights: Tensor,
}

impl ScalarCodec {
    /// `codec`'s rule on `dev`; an error for codecs with no scalar form (VecInfer's codebooks go
    /// through [`TensorCodec`](super::codec::TensorCodec)).
    pub fn new(codec: &dyn BlockCodec, dev: &Device) -> Result<Self> {
        let dim = codec.head_dim();
        let form = codec
            .scalar_form()
            .ok_or_else(|| Error::Config(format!("{} has no element-wise form for tensor ops", codec.name())))?;
        if !dim.is_multiple_of(8) {
            return Err(Error::Shape(format!("head_dim {dim} is not a multiple of 8 (codes pack 8 per byte)")));
        }
        let (bits, rule) = match form {
            ScalarForm::Kivi { bits, group, axis: KiviAxis::PerChannel } => (bits, Rule::PerChannel { group }),
            ScalarForm::Kivi { bits, group, axis: KiviAxis::PerToken } => (bits, Rule::PerToken { group }),
            ScalarForm::LloydMax { bits, signs, levels, bounds } => (
                bits,
                Rule::LloydMax {
                    signs: Tensor::from_slice(signs, dim, dev)?,
                    rot: hadamard(dim, dev)?,
                    levels: Tensor::from_slice(levels, levels.len(), dev)?,
                    bounds: Tensor::from_slice(bounds, bounds.len(), dev)?,
                },
            ),
        };
        let bits = bits as usize;
        let pow = |n: usize, sign: i32| -> Vec<f32> { (0..n).map(|k| 2f32.powi(sign * k as i32)).collect() };
        Ok(Self {
            bits,
            dim,
            rule,
            halves: Tensor::from_vec(pow(bits + 1, -1), bits + 1, dev)?,
            byte_halves: Tensor::from_vec(pow(9, -1), 9, dev)?,
            plane_weights: Tensor::from_vec(pow(bits, 1), (bits, 1), dev)?,
            byte_weights: Tensor::from_vec(pow(8, 1), 8, dev)?,
        })
    }

    /// Positions one metadata row covers (encode and decode spans are multiples of it, aligned).
    pub fn group_tokens(&self) -> usize {
        match self.rule {
            Rule::PerChannel { group } => group,
            _ => 1,
        }
    }

    /// Bytes of packed codes per position and kv head.
    pub fn packed_width(&self) -> usize {
        self.bits * self.dim / 8
    }

    /// Metadata per metadata row and kv head: `(planes, width)` f16 values.
    pub fn meta_shape(&self) -> (usize, usize) {
        match self.rule {
            Rule::PerChannel { .. } => (2, self.dim),
            Rule::PerToken { group } => (2, self.dim / group),
            Rule::LloydMax { .. } => (1, 1),
        }
    }

    /// Rows `[kv, n, D]` (f32 or f16; n a multiple of [`group_tokens`](Self::group_tokens)) →
    /// packed codes `[kv, n, packed_width]` u8 and metadata `[kv, n / group_tokens, planes, width]`
    /// f16.
    pub fn encode(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        let (kv, n, d) = x.dims3()?;
        let x = x.to_dtype(DType::F32)?;
        let levels = ((1u32 << self.bits) - 1) as f64;
        // x ≈ min + step·q against the f16-rounded min and step the decoder sees, as the codec does.
        let affine = |x: &Tensor, lo: &Tensor, hi: &Tensor, dim: usize| -> Result<(Tensor, Tensor)> {
            let min = lo.to_dtype(DType::F16)?;
            let step = (hi - lo)?.broadcast_div(&Tensor::new(levels as f32, x.device())?)?.to_dtype(DType::F16)?;
            let (m, s) = (min.to_dtype(DType::F32)?, step.to_dtype(DType::F32)?);
            let inv = s.gt(0f32)?.where_cond(&s.recip()?, &s.zeros_like()?)?;
            let q = x.broadcast_sub(&m)?.broadcast_mul(&inv)?.round()?.clamp(0f32, levels as f32)?;
            Ok((q, Tensor::cat(&[&min, &step], dim)?))
        };
        let (codes, meta) = match &self.rule {
            Rule::PerChannel { group } => {
                let g = x.reshape((kv, n / group, *group, d))?;
                let (q, meta) = affine(&g, &g.min_keepdim(2)?, &g.max_keepdim(2)?, 2)?;
                (q.reshape((kv, n, d))?, meta)
            }
            Rule::PerToken { group } => {
                let g = x.reshape((kv, n, d / group, *group))?;
                let (q, meta) = affine(&g, &g.min_keepdim(3)?, &g.max_keepdim(3)?, 3)?;
                (q.reshape((kv, n, d))?, meta.transpose(2, 3)?)
            }
            Rule::LloydMax { signs, rot, bounds, .. } => {
                let y = x.broadcast_mul(signs)?.reshape((kv * n, d))?.matmul(rot)?.reshape((kv, n, d))?;
                let rms = y.sqr()?.mean_keepdim(D::Minus1)?.sqrt()?.to_dtype(DType::F16)?;
                let r = rms.to_dtype(DType::F32)?;
                let inv = r.gt(0f32)?.where_cond(&r.recip()?, &r.zeros_like()?)?;
                // The level is the number of boundaries below the value.
                let z = y.broadcast_mul(&inv)?.unsqueeze(3)?;
                let q = z.broadcast_gt(bounds)?.to_dtype(DType::F32)?.sum(3)?;
                (q, rms.unsqueeze(3)?)
            }
        };
        Ok((self.pack(&codes)?, meta.contiguous()?))
    }

    /// Packed codes `[kv, n, packed_width]` and their metadata (as [`encode`](Self::encode)
    /// wrote them) → rows `[kv, n, D]` f32.
    pub fn decode(&self, packed: &Tensor, meta: &Tensor) -> Result<Tensor> {
        let q = self.unpack(packed)?;
        let (kv, n, d) = q.dims3()?;
        let meta = meta.to_dtype(DType::F32)?;
        let plane = |i: usize| meta.narrow(2, i, 1);
        Ok(match &self.rule {
            Rule::PerChannel { group } => {
                let q = q.reshape((kv, n / group, *group, d))?;
                plane(0)?.broadcast_add(&q.broadcast_mul(&plane(1)?)?)?.reshape((kv, n, d))?
            }
            Rule::PerToken { group } => {
                let q = q.reshape((kv, n, d / group, *group))?;
                let (min, step) = (plane(0)?.transpose(2, 3)?, plane(1)?.transpose(2, 3)?);
                min.broadcast_add(&q.broadcast_mul(&step)?)?.reshape((kv, n, d))?
            }
            Rule::LloydMax { signs, rot, levels, .. } => {
                let y = levels.index_select(&q.to_dtype(DType::U32)?.flatten_all()?, 0)?.reshape((kv, n, d))?;
                let y = y.broadcast_mul(&meta.reshape((kv, n, 1))?)?;
                y.reshape((kv * n, d))?.matmul(rot)?.reshape((kv, n, d))?.broadcast_mul(signs)?
            }
        })
    }

    /// Codes `[kv, n, D]` (integers in f32) → `[kv, n, bits · D / 8]` u8: bit-plane k of 8
    /// consecutive elements in one byte. Every step is exact in f32 (powers of two, floors).
    fn pack(&self, q: &Tensor) -> Result<Tensor> {
        let (kv, n, d) = q.dims3()?;
        let b = self.bits;
        let a = q.unsqueeze(3)?.broadcast_mul(&self.halves)?.floor()?; // [kv, n, D, b+1]: ⌊q / 2ᵏ⌋
        let bits = (a.narrow(3, 0, b)? - (a.narrow(3, 1, b)? * 2.0)?)?; // bit k of q
        let bits = bits.permute((0, 1, 3, 2))?.reshape((kv, n, b, d / 8, 8))?;
        Ok(bits.broadcast_mul(&self.byte_weights)?.sum(4)?.reshape((kv, n, b * d / 8))?.to_dtype(DType::U8)?)
    }

    /// The inverse of [`pack`](Self::pack): `[kv, n, packed_width]` u8 → `[kv, n, D]` f32 codes.
    fn unpack(&self, p: &Tensor) -> Result<Tensor> {
        let (kv, n, w) = p.dims3()?;
        let (b, d) = (self.bits, w * 8 / self.bits);
        let a = p.to_dtype(DType::F32)?.reshape((kv, n, b, d / 8, 1))?.broadcast_mul(&self.byte_halves)?.floor()?;
        let bits = (a.narrow(4, 0, 8)? - (a.narrow(4, 1, 8)? * 2.0)?)?.reshape((kv, n, b, d))?;
        Ok(bits.broadcast_mul(&self.plane_weights)?.sum(2)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use veloq::codec::kivi::KiviCodec;
    use veloq::codec::lloyd_max::LloydMaxCodec;

    use crate::testing::fresh_seed;

    /// `[rows, dim]` normal draws (Box–Muller over a xorshift) with three outlier channels.
    fn outlier_rows(seed: u64, rows: usize, dim: usize) -> Vec<f32> {
        let mut s = seed | 1;
        let mut uniform = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        (0..rows * dim)
            .map(|i| {
                let z = (-2.0 * uniform().ln()).sqrt() * (std::f64::consts::TAU * uniform()).cos();
                let c = i % dim;
                (z * if c == 1 || c == dim / 3 || c == dim - 2 { 12.0 } else { 1.0 }) as f32
            })
            .collect()
    }

    fn rows_tensor(x: &[f32], tokens: usize, heads: usize, dim: usize) -> Tensor {
        Tensor::from_slice(x, (tokens, heads, dim), &Device::Cpu).unwrap().transpose(0, 1).unwrap()
    }

    /// `[kv, n, …]` → the CPU codec's order, token-major: `[n, kv, …]` flattened.
    fn token_major<T: candle_core::WithDType>(t: &Tensor) -> Vec<T> {
        t.transpose(0, 1).unwrap().flatten_all().unwrap().to_vec1::<T>().unwrap()
    }

    /// KIVI's rule is the same f32 steps as its CPU codec (min, max, one division, a round), so
    /// the decoded rows agree to within f32 rounding.
    #[test]
    fn kivi_decodes_what_the_codec_decodes() {
        let seed = fresh_seed();
        let (heads, dim, tokens) = (3, 64, 64);
        let x = outlier_rows(seed, tokens * heads, dim); // [tokens, heads, dim]
        let rows = rows_tensor(&x, tokens, heads, dim);
        for bits in [2u32, 3, 4] {
            for axis in [KiviAxis::PerChannel, KiviAxis::PerToken] {
                let c = KiviCodec::new(heads, dim, bits, 32, axis).unwrap();
                let mut want = vec![0.0f32; x.len()];
                c.decode(&c.encode_vec(&x).unwrap(), &mut want).unwrap();
                let t = ScalarCodec::new(&c, &Device::Cpu).unwrap();
                let (packed, meta) = t.encode(&rows).unwrap();
                assert_eq!(packed.elem_count() + meta.elem_count() * 2, c.encoded_len(tokens), "{}", c.name());
                let got = token_major::<f32>(&t.decode(&packed, &meta).unwrap());
                let tol = 1e-5 * want.iter().fold(0f32, |m, v| m.max(v.abs()));
                let off = (0..x.len()).filter(|&i| (got[i] - want[i]).abs() > tol).count();
                assert_eq!(off, 0, "seed {seed} {} {bits}b: {off} of {} differ", c.name(), x.len());
            }
        }
    }

    /// Lloyd–Max rotates by a matmul here and by a butterfly in the CPU codec, and the two round
    /// differently (the matmul's order depends on the CPU's vector width). So each half is checked
    /// against an exact reference instead of the decoded rows against each other: the encoder's rms
    /// is the codec's or its f16 neighbour, and each code is the codec's unless the rotated value
    /// lies, within that rounding, on the boundary between the two levels; the decoder turns
    /// codes into what the CPU codec decodes from the same codes, to within f32 rounding.
    #[test]
    fn lloyd_max_codes_and_decodes_as_the_codec_does() {
        let seed = fresh_seed();
        let (heads, dim, tokens) = (3, 64, 64);
        let x = outlier_rows(seed, tokens * heads, dim);
        let rows = rows_tensor(&x, tokens, heads, dim);
        let vectors = tokens * heads;
        for bits in [2u32, 3, 4] {
            let c = LloydMaxCodec::new(heads, dim, bits, seed).unwrap();
            let t = ScalarCodec::new(&c, &Device::Cpu).unwrap();
            let Rule::LloydMax { signs, rot, bounds, levels } = &t.rule else { panic!("not Lloyd–Max") };
            let (signs, rot) = (signs.to_vec1::<f32>().unwrap(), rot.to_vec2::<f32>().unwrap());
            let (bounds, levels) = (bounds.to_vec1::<f32>().unwrap(), levels.to_vec1::<f32>().unwrap());
            let bytes = c.encode_vec(&x).unwrap();
            let (scales, packed_c) = bytes.split_at(vectors * 2);
            let rms_c: Vec<f32> =
                scales.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect();
            let mut codes_c = vec![0u16; x.len()];
            veloq::codec::pack::unpack(packed_c, bits, &mut codes_c).unwrap();

            let (packed, meta) = t.encode(&rows).unwrap();
            let rms_t = token_major::<half::f16>(&meta.squeeze(3).unwrap().squeeze(2).unwrap());
            let rms_t: Vec<f32> = rms_t.iter().map(|r| r.to_f32()).collect();
            let codes_t: Vec<u16> = token_major::<f32>(&t.unpack(&packed).unwrap()).iter().map(|&q| q as u16).collect();
            let mut flips = 0;
            for v in 0..vectors {
                let (a, b) = (rms_t[v], rms_c[v]);
                assert!((a - b).abs() <= b.abs() * 2f32.powi(-10), "seed {seed} {bits}b row {v}: rms {a} vs {b}");
                let xs = &x[v * dim..(v + 1) * dim];
                for i in 0..dim {
                    let (qt, qc) = (codes_t[v * dim + i], codes_c[v * dim + i]);
                    if qt == qc {
                        continue;
                    }
                    // The rotated value in f64, and the boundary between the two levels.
                    let y: f64 = (0..dim).map(|j| (xs[j] * signs[j]) as f64 * rot[j][i] as f64).sum();
                    let z = y / a as f64;
                    let bound = bounds[qt.min(qc) as usize] as f64;
                    // The rms may differ by one f16 step (2⁻¹⁰ relative); either f32 rotation may
                    // be off by dim·u of the magnitudes it sums.
                    let mass: f64 = xs.iter().map(|&v| v.abs() as f64).sum::<f64>() / (dim as f64).sqrt();
                    let margin = z.abs() * 2f64.powi(-9) + 2.0 * dim as f64 * 2f64.powi(-24) * mass / a as f64;
                    assert!(
                        qt.abs_diff(qc) == 1 && (z - bound).abs() <= margin,
                        "seed {seed} {bits}b row {v} channel {i}: code {qt} vs {qc} at z = {z} (boundary {bound})"
                    );
                    flips += 1;
                }
            }
            assert!(flips < x.len() / 100, "seed {seed} {bits}b: {flips} boundary codes");

            // The decoder, from the tensor's own codes and rms laid out as the CPU codec's bytes.
            let mut bytes_t: Vec<u8> = rms_t.iter().flat_map(|&r| half::f16::from_f32(r).to_le_bytes()).collect();
            let mut packed_t = vec![0u8; packed_c.len()];
            veloq::codec::pack::pack(&codes_t, bits, &mut packed_t).unwrap();
            bytes_t.extend(packed_t);
            let mut want = vec![0.0f32; x.len()];
            c.decode(&bytes_t, &mut want).unwrap();
            let got = token_major::<f32>(&t.decode(&packed, &meta).unwrap());
            for v in 0..vectors {
                // Each output is a sum of `dim` terms |level|·rms/√dim: both orders stay within
                // dim·u of the sum of their magnitudes (u = 2⁻²⁴).
                let mass: f32 =
                    codes_t[v * dim..(v + 1) * dim].iter().map(|&q| levels[q as usize].abs() * rms_t[v]).sum();
                let tol = 2.0 * dim as f32 * 2f32.powi(-24) * mass / (dim as f32).sqrt();
                for i in v * dim..(v + 1) * dim {
                    assert!(
                        (got[i] - want[i]).abs() <= tol,
                        "seed {seed} {bits}b: {} vs {} (tol {tol})",
                        got[i],
                        want[i]
                    );
                }
            }
        }
    }

    /// A codec only its own encode/decode can run.
    #[derive(Debug)]
    struct Opaque;
    impl BlockCodec for Opaque {
        fn name(&self) -> String {
            "opaque".into()
        }
        fn n_heads(&self) -> usize {
            1
        }
        fn head_dim(&self) -> usize {
            64
        }
        fn encoded_len(&self, tokens: usize) -> usize {
            tokens
        }
        fn encode(&self, _: &[f32], _: &mut [u8]) -> veloq::Result<()> {
            Ok(())
        }
        fn decode(&self, _: &[u8], _: &mut [f32]) -> veloq::Result<()> {
            Ok(())
        }
        fn resident_bytes(&self) -> usize {
            0
        }
    }

    #[test]
    fn refuses_codecs_without_a_scalar_form() {
        let e = ScalarCodec::new(&Opaque, &Device::Cpu).unwrap_err();
        assert!(e.to_string().contains("opaque"), "{e}");
    }
}
