//! Keys coded around their pre-RoPE mean turned to each position (issue 34's candidate, after
//! KVQuant's pre-RoPE keys). A key head's channels carry large constant means before RoPE; after
//! it, a pair's mean turns with the position, so the codec's per-channel centering (post-RoPE)
//! cannot remove it and the codebook spends centroids on it. With μ the pre-RoPE mean per (kv
//! head, channel) and R(p) RoPE at position p, a row is coded as k − R(p)μ and read back as
//! R(p)μ + k̂ — attention would add q·R(p)μ to each score. The few rows the turning mean does
//! not describe (those that carry attention, measured: `examples/rope_center`) code better as
//! they are, so each (position, kv head) row takes whichever of the two codes reconstructs it
//! closer: one flag bit a row.

use candle_core::{DType, Tensor};

use veloq::codec::vecinfer::VecInferCodec;
use veloq_candle::error::{Error, Result};
use veloq_candle::model::arch::RopeStyle;
use veloq_candle::model::Model;

use crate::simulate::round_trip;

/// One layer's RoPE as the model applies it: its cosine and sine tables on the host.
#[derive(Clone)]
pub struct Rope {
    cos: Vec<f32>,
    sin: Vec<f32>,
    half: usize,
    style: RopeStyle,
}

impl Rope {
    /// Layer `layer`'s tables of `model`.
    pub fn of(model: &Model, layer: usize) -> Result<Self> {
        let (c, s) = model.rope_tables(layer);
        let host = |t: &Tensor| -> Result<Vec<f32>> { Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?) };
        let half = c.dim(1)?;
        Ok(Self { cos: host(c)?, sin: host(s)?, half, style: model.info.arch.rope })
    }

    /// Llama's tables (base 10,000, interleaved pairs) for `positions` positions of `head_dim`
    /// channels, without a model.
    #[cfg(test)]
    pub(crate) fn synthetic(head_dim: usize, positions: usize) -> Self {
        let half = head_dim / 2;
        let angle = |p: usize, i: usize| p as f32 / 10_000f32.powf(2.0 * i as f32 / head_dim as f32);
        let table = |f: fn(f32) -> f32| (0..positions).flat_map(|p| (0..half).map(move |i| f(angle(p, i)))).collect();
        Self { cos: table(f32::cos), sin: table(f32::sin), half, style: RopeStyle::Interleaved }
    }

    /// Positions the tables reach.
    pub fn positions(&self) -> usize {
        self.cos.len() / self.half.max(1)
    }

    /// Rotates `head` (`head_dim` channels) by position `p`'s angles, backwards when `back`.
    pub fn turn(&self, head: &mut [f32], p: usize, back: bool) {
        let h = self.half;
        let (c, s) = (&self.cos[p * h..(p + 1) * h], &self.sin[p * h..(p + 1) * h]);
        for i in 0..h {
            let (a, b) = match self.style {
                RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                RopeStyle::NeoX => (i, i + h),
            };
            let (x, y, sn) = (head[a], head[b], if back { -s[i] } else { s[i] });
            head[a] = x * c[i] - y * sn;
            head[b] = x * sn + y * c[i];
        }
    }

    /// Zeroes all but the `pairs` RoPE pairs of largest norm in each head of `mean`
    /// (`[heads, head_dim]`): what attention's q·R(p)μ then costs, a complex multiply-add a
    /// position per pair kept.
    pub fn keep_largest_pairs(&self, mean: &mut [f32], pairs: usize) {
        let h = self.half;
        let at = |i: usize| match self.style {
            RopeStyle::Interleaved => (2 * i, 2 * i + 1),
            RopeStyle::NeoX => (i, i + h),
        };
        for head in mean.chunks_exact_mut(2 * h) {
            let norm = |i: usize| head[at(i).0].hypot(head[at(i).1]);
            let mut order: Vec<usize> = (0..h).collect();
            order.sort_by(|&x, &y| norm(y).total_cmp(&norm(x)));
            for &i in &order[pairs.min(h)..] {
                let (a, b) = at(i);
                head[a] = 0.0;
                head[b] = 0.0;
            }
        }
    }

    /// Every `[tokens, heads, head_dim]` row turned by its position (`position(t)` for token t).
    pub fn turn_rows(&self, rows: &mut [f32], heads: usize, position: impl Fn(usize) -> usize, back: bool) {
        let d = 2 * self.half;
        for (t, tok) in rows.chunks_exact_mut(heads * d).enumerate() {
            tok.chunks_exact_mut(d).for_each(|head| self.turn(head, position(t), back));
        }
    }
}

/// The pre-RoPE mean per (kv head, channel), `[heads, head_dim]`, of keys recorded in passes of
/// `window` positions (token t at position t % `window`).
pub fn pre_rope_mean(keys: &[f32], heads: usize, window: usize, rope: &Rope) -> Vec<f32> {
    let row = heads * 2 * rope.half;
    let mut pre = keys.to_vec();
    rope.turn_rows(&mut pre, heads, |t| t % window, true);
    let tokens = (pre.len() / row.max(1)).max(1);
    let mut mean = vec![0.0f64; row];
    pre.chunks_exact(row).for_each(|r| mean.iter_mut().zip(r).for_each(|(m, &x)| *m += x as f64));
    mean.iter().map(|&m| (m / tokens as f64) as f32).collect()
}

/// The turning mean R(p)μ of `tokens` rows, `[tokens, heads, head_dim]` (`position(t)` for token t).
pub fn turned_mean(
    tokens: usize,
    mean: &[f32],
    heads: usize,
    rope: &Rope,
    position: impl Fn(usize) -> usize,
) -> Vec<f32> {
    let mut turned: Vec<f32> = (0..tokens).flat_map(|_| mean.iter().copied()).collect();
    rope.turn_rows(&mut turned, heads, position, false);
    turned
}

/// `rows` minus the turning mean at each row's position (`position(t)` for token t).
pub fn shifted(rows: &[f32], mean: &[f32], heads: usize, rope: &Rope, position: impl Fn(usize) -> usize) -> Vec<f32> {
    let turned = turned_mean(rows.len() / mean.len().max(1), mean, heads, rope, position);
    rows.iter().zip(&turned).map(|(k, m)| k - m).collect()
}

/// Per row of `d` channels, whichever of two reconstructions `a` and `b` of `rows` is closer to
/// it in squared error (`a` on a tie; one flag bit a row), and how many rows took `b`.
pub fn closer_per_row(rows: &[f32], a: &[f32], b: &[f32], d: usize) -> (Vec<f32>, usize) {
    let mut out = Vec::with_capacity(rows.len());
    let mut took_b = 0;
    for ((k, x), y) in rows.chunks_exact(d).zip(a.chunks_exact(d)).zip(b.chunks_exact(d)) {
        let err = |r: &[f32]| r.iter().zip(k).map(|(r, k)| (r - k) * (r - k)).sum::<f32>();
        let take = err(y) < err(x);
        took_b += take as usize;
        out.extend_from_slice(if take { y } else { x });
    }
    (out, took_b)
}

/// One layer's keys coded both ways, each row by the closer.
#[derive(Clone)]
pub struct TurningKeys {
    /// The method's own key codec.
    pub base: VecInferCodec,
    /// The codec of keys minus the turning mean.
    pub shifted: VecInferCodec,
    /// The pre-RoPE mean, `[kv heads, head_dim]`.
    pub mean: Vec<f32>,
    /// The layer's RoPE.
    pub rope: Rope,
}

/// What [`TurningKeys::round_trip`] did: the reconstruction and how many rows took the shifted code.
pub struct TurningRoundTrip {
    /// `[tokens, heads, head_dim]`.
    pub rows: Vec<f32>,
    /// Rows coded around the turning mean.
    pub shifted_rows: usize,
}

impl TurningKeys {
    /// `rows` (`[tokens, kv heads, head_dim]`, token t at position `start + t`) coded and decoded.
    pub fn round_trip(&self, rows: &[f32], start: usize) -> Result<TurningRoundTrip> {
        let d = self.base.head_dim();
        let heads = self.mean.len() / d.max(1);
        if heads == 0 || !rows.len().is_multiple_of(heads * d) {
            return Err(Error::Shape(format!("{} values are not rows of {heads} heads × {d}", rows.len())));
        }
        let tokens = rows.len() / (heads * d);
        if start + tokens > self.rope.positions() {
            return Err(Error::Config(format!(
                "positions to {} past the RoPE tables' {}",
                start + tokens,
                self.rope.positions()
            )));
        }
        let plain = round_trip(&self.base, rows)?;
        let turned = turned_mean(tokens, &self.mean, heads, &self.rope, |t| start + t);
        let around: Vec<f32> = rows.iter().zip(&turned).map(|(k, m)| k - m).collect();
        let mut back = round_trip(&self.shifted, &around)?;
        back.iter_mut().zip(&turned).for_each(|(x, m)| *x += m);
        let (rows, shifted_rows) = closer_per_row(rows, &plain, &back, d);
        Ok(TurningRoundTrip { rows, shifted_rows })
    }

    /// Bits per key element the flag adds.
    pub fn flag_bits(&self) -> f64 {
        1.0 / self.base.head_dim() as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rope(style: RopeStyle, d: usize, positions: usize) -> Rope {
        Rope { style, ..Rope::synthetic(d, positions) }
    }

    /// Turning forward then back is the identity, and turning keeps each pair's norm (RoPE is a
    /// rotation of each pair), for both pairings.
    #[test]
    fn turning_back_undoes_turning_and_keeps_pair_norms() {
        let mut rng = crate::synthetic::Rng(crate::testing::fresh_seed() | 1);
        for style in [RopeStyle::Interleaved, RopeStyle::NeoX] {
            let r = rope(style, 8, 64);
            let rows: Vec<f32> = (0..5 * 2 * 8).map(|_| rng.normal()).collect();
            let mut x = rows.clone();
            r.turn_rows(&mut x, 2, |t| 7 + 11 * t, false);
            let pair = |v: &[f32], i: usize| match style {
                RopeStyle::Interleaved => v[2 * i].hypot(v[2 * i + 1]),
                RopeStyle::NeoX => v[i].hypot(v[i + 4]),
            };
            for (a, b) in rows.chunks(8).zip(x.chunks(8)) {
                (0..4).for_each(|i| assert!((pair(a, i) - pair(b, i)).abs() < 1e-5));
            }
            assert!(rows.iter().zip(&x).any(|(a, b)| (a - b).abs() > 1e-2), "a turn moves the rows");
            r.turn_rows(&mut x, 2, |t| 7 + 11 * t, true);
            rows.iter().zip(&x).for_each(|(a, b)| assert!((a - b).abs() < 1e-5, "{a} {b}"));
        }
    }

    /// Keys made of a constant pre-RoPE vector turned to their positions plus small noise: the
    /// pre-RoPE mean recovers the vector within the noise's standard error, and the shifted rows
    /// are the noise.
    #[test]
    fn the_pre_rope_mean_of_turned_constants_is_the_constant() {
        let mut rng = crate::synthetic::Rng(crate::testing::fresh_seed() | 1);
        let (d, heads, window, tokens) = (8, 2, 32, 96);
        let r = rope(RopeStyle::Interleaved, d, window);
        let mu: Vec<f32> = (0..heads * d).map(|_| 3.0 * rng.normal()).collect();
        let noise: Vec<f32> = (0..tokens * heads * d).map(|_| 0.01 * rng.normal()).collect();
        let mut keys: Vec<f32> = (0..tokens).flat_map(|_| mu.iter().copied()).collect();
        r.turn_rows(&mut keys, heads, |t| t % window, false);
        keys.iter_mut().zip(&noise).for_each(|(k, n)| *k += n);
        let got = pre_rope_mean(&keys, heads, window, &r);
        // The mean of 96 draws of σ = 0.01 has σ 0.001; 6σ bounds it.
        got.iter().zip(&mu).for_each(|(g, m)| assert!((g - m).abs() < 6e-3, "{g} {m}"));
        // What is left is the noise, plus the mean's error turned: per channel at most its pair's
        // error, √2 × 6e-3 < 1e-2.
        let left = shifted(&keys, &got, heads, &r, |t| t % window);
        left.iter().zip(&noise).for_each(|(l, n)| assert!((l - n).abs() < 1e-2, "{l} {n}"));
    }

    /// Each row comes back as one of its two codes (the method's, or the shifted one turned
    /// back), the closer to it; so no row is coded worse than by the method alone, and rows made
    /// of the turning mean plus what the shifted books know take the shifted code.
    #[test]
    fn each_row_takes_the_closer_of_its_two_codes() {
        use veloq::codec::codebook::PqShape;
        use veloq::codec::vecinfer::CodecSpec;
        let mut rng = crate::synthetic::Rng(crate::testing::fresh_seed() | 1);
        let (d, heads, tokens, start) = (8, 2, 40, 5);
        let r = rope(RopeStyle::NeoX, d, start + tokens);
        let spec = CodecSpec::keys(PqShape::new(4, 4).unwrap());
        let base = crate::synthetic::codec(&mut rng, heads, d, &spec).unwrap();
        let shifted_books = crate::synthetic::codec(&mut rng, heads, d, &spec).unwrap();
        let mean: Vec<f32> = (0..heads * d).map(|_| 6.0 * rng.normal()).collect();
        let keys =
            TurningKeys { base: base.clone(), shifted: shifted_books.clone(), mean: mean.clone(), rope: r.clone() };
        // Half the tokens around the turning mean, half plain key-like rows.
        let mut rows = rng.rows(tokens * heads, d);
        let mut turned: Vec<f32> = (0..tokens).flat_map(|_| mean.iter().copied()).collect();
        r.turn_rows(&mut turned, heads, |t| start + t, false);
        rows.iter_mut()
            .zip(&turned)
            .enumerate()
            .filter(|(i, _)| i / (heads * d) % 2 == 0)
            .for_each(|(_, (x, m))| *x += m);
        let got = keys.round_trip(&rows, start).unwrap();
        let plain = round_trip(&base, &rows).unwrap();
        let around = shifted(&rows, &mean, heads, &r, |t| start + t);
        let neg: Vec<f32> = mean.iter().map(|m| -m).collect();
        let back = shifted(&round_trip(&shifted_books, &around).unwrap(), &neg, heads, &r, |t| start + t);
        let err = |a: &[f32], k: &[f32]| a.iter().zip(k).map(|(a, k)| (a - k) * (a - k)).sum::<f32>();
        let mut took = 0;
        for (((g, k), a), b) in got.rows.chunks(d).zip(rows.chunks(d)).zip(plain.chunks(d)).zip(back.chunks(d)) {
            let one_of = g == a || g == b;
            assert!(one_of, "a row is one of its two codes");
            assert!(err(g, k) <= err(a, k) && err(g, k) <= err(b, k), "and the closer");
            took += (g == b && g != a) as usize;
        }
        assert_eq!(took, got.shifted_rows);
        assert!(got.shifted_rows > 0, "some rows take the shifted code");
        assert!(keys.round_trip(&rows[..d], start).is_err(), "half a token");
        assert!(keys.round_trip(&rows, 10).is_err(), "past the tables");
    }

    /// A model's tables as read here are Llama's RoPE angles (the tiny model: base 10,000,
    /// interleaved pairs), position by position.
    #[test]
    fn a_models_tables_are_its_rope_angles() {
        let model = crate::testing::tiny_model(32, 48);
        // Angles to 47 radians in f32: candle's product and this sum round them within 1e-5.
        let got = Rope::of(&model, 1).unwrap();
        let want = Rope::synthetic(model.info.identity.head_dim, 48);
        assert_eq!((got.positions(), got.half, got.style), (48, want.half, RopeStyle::Interleaved));
        got.cos.iter().zip(&want.cos).for_each(|(a, b)| assert!((a - b).abs() < 1e-5, "{a} {b}"));
        got.sin.iter().zip(&want.sin).for_each(|(a, b)| assert!((a - b).abs() < 1e-5, "{a} {b}"));
    }

    /// Kept pairs are the largest per head, whole (both channels), for both pairings.
    #[test]
    fn the_largest_pairs_are_kept_whole() {
        for style in [RopeStyle::Interleaved, RopeStyle::NeoX] {
            let r = rope(style, 8, 4);
            // Pair norms per head: head 0 pairs 0..4 have norms 1, 5, 3, 4; head 1 reversed.
            let pair = |i: usize| match style {
                RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                RopeStyle::NeoX => (i, i + 4),
            };
            let mut mean = vec![0.0f32; 16];
            for (h, norms) in [[1.0f32, 5.0, 3.0, 4.0], [4.0, 3.0, 5.0, 1.0]].iter().enumerate() {
                for (i, n) in norms.iter().enumerate() {
                    let (a, b) = pair(i);
                    mean[h * 8 + a] = 0.6 * n;
                    mean[h * 8 + b] = 0.8 * n;
                }
            }
            let full = mean.clone();
            r.keep_largest_pairs(&mut mean, 2);
            for (h, kept) in [[1usize, 3], [0, 2]].iter().enumerate() {
                for i in 0..4 {
                    let (a, b) = pair(i);
                    let want = |c: usize| if kept.contains(&i) { full[h * 8 + c] } else { 0.0 };
                    assert_eq!((mean[h * 8 + a], mean[h * 8 + b]), (want(a), want(b)), "{style:?} head {h} pair {i}");
                }
            }
        }
    }
}
