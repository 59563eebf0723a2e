//! Value codebooks weighted by attention: k-means spends its centroids on the value rows the
//! softmax reads. Each coded position's attention mass is measured on the calibration text's own
//! queries, and the rows the value books train on are drawn in proportion to it (a weighted
//! k-means by resampling, which leaves the codec's training untouched).

use std::fmt;
use std::str::FromStr;

use rayon::prelude::*;

use crate::error::{Error, Result};

/// What the value codebooks' k-means weighs each recorded row by.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ValueWeights {
    /// Every row alike (plain k-means on the rows).
    #[default]
    Uniform,
    /// By the attention each position receives while the cache holds it coded.
    Attention,
}

impl ValueWeights {
    /// The name the CLI, the artifact and the bindings use.
    pub fn name(self) -> &'static str {
        match self {
            ValueWeights::Uniform => "uniform",
            ValueWeights::Attention => "attention",
        }
    }
}

impl fmt::Display for ValueWeights {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ValueWeights {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "uniform" => Ok(ValueWeights::Uniform),
            "attention" => Ok(ValueWeights::Attention),
            other => Err(Error::Config(format!("value weights {other:?}: uniform or attention"))),
        }
    }
}

/// Where queries are sampled and which positions they see coded: every `stride`-th position of
/// each `window`-position pass from the `skip`-th on; of the positions before a query, the first
/// `sink` and the last `recent` stay exact (the cache's residency), the rest are coded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuerySampling {
    /// Positions per recorded pass (each attends only within its pass).
    pub window: usize,
    /// Every this many positions a query is sampled.
    pub stride: usize,
    /// Positions of each pass before the first sampled query.
    pub skip: usize,
    /// First positions of a pass kept exact.
    pub sink: usize,
    /// Positions before a query (its own included) kept exact.
    pub recent: usize,
}

impl QuerySampling {
    /// The sampled queries of `tokens` positions: (their pass's first position, their own).
    pub fn queries(&self, tokens: usize) -> Vec<(usize, usize)> {
        (0..tokens)
            .step_by(self.window.max(1))
            .flat_map(|w0| {
                (w0 + self.skip..(w0 + self.window).min(tokens)).step_by(self.stride.max(1)).map(move |r| (w0, r))
            })
            .collect()
    }

    /// Whether the query at position `p` of a pass is sampled: what a recorder keeps, pass by
    /// pass, so that it holds [`Self::queries`]' rows in their order.
    pub fn samples(&self, p: usize) -> bool {
        p >= self.skip && p < self.window && (p - self.skip).is_multiple_of(self.stride.max(1))
    }

    /// The sampled rows of every position's queries (`row` values a position), in
    /// [`Self::queries`]' order: what [`coded_mass`] reads.
    pub fn gather(&self, queries: &[f32], row: usize) -> Vec<f32> {
        let tokens = queries.len() / row.max(1);
        self.queries(tokens).iter().flat_map(|&(_, r)| &queries[r * row..(r + 1) * row]).copied().collect()
    }

    /// Whether position `i` of a pass is coded for a query that sees `n` positions.
    pub fn coded(&self, i: usize, n: usize) -> bool {
        i >= self.sink && i + self.recent < n
    }
}

/// One layer's recorded attention inputs: keys `[tokens, kv heads, head_dim]`, the sampled
/// positions' queries `[sampled, heads, head_dim]` in [`QuerySampling::queries`]' order (heads a
/// multiple of kv heads) and the attention scale.
#[derive(Clone, Copy, Debug)]
pub struct AttentionRows<'a> {
    /// Post-RoPE keys.
    pub keys: &'a [f32],
    /// Post-RoPE queries of the sampled positions only (an eighth of the text's at stride 8).
    pub queries: &'a [f32],
    /// The softmax's scale.
    pub scale: f32,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Channels per head.
    pub head_dim: usize,
}

/// Per (position, kv head), `[tokens, kv heads]`: the attention that the sampled queries of the kv
/// head's query group put on the position while it is coded, summed over those queries and
/// heads. Exact keys score.
pub fn coded_mass(rows: AttentionRows, at: QuerySampling) -> Result<Vec<f64>> {
    let AttentionRows { keys, queries, scale, heads: nh, kv_heads: nkv, head_dim: d } = rows;
    if nh == 0 || nkv == 0 || d == 0 || !nh.is_multiple_of(nkv) || !keys.len().is_multiple_of(nkv * d) {
        return Err(Error::Shape(format!("{} keys of {nkv} kv heads × {d} for {nh} query heads", keys.len())));
    }
    let tokens = keys.len() / (nkv * d);
    let sampled = at.queries(tokens);
    if queries.len() != sampled.len() * nh * d {
        return Err(Error::Shape(format!(
            "{} query values for {} sampled positions of {nh} heads × {d} (queries recorded?)",
            queries.len(),
            sampled.len()
        )));
    }
    let group = nh / nkv;
    let zero = || vec![0.0f64; tokens * nkv];
    let mass = sampled
        .par_iter()
        .enumerate()
        .fold(zero, |mut mass, (j, &(w0, r))| {
            let n = r - w0 + 1;
            let mut s = vec![0.0f64; n];
            for h in 0..nh {
                let kv = h / group;
                let q = &queries[(j * nh + h) * d..(j * nh + h + 1) * d];
                for (i, si) in s.iter_mut().enumerate() {
                    let k = &keys[((w0 + i) * nkv + kv) * d..((w0 + i) * nkv + kv + 1) * d];
                    *si = (scale * q.iter().zip(k).map(|(x, y)| x * y).sum::<f32>()) as f64;
                }
                let top = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|x| (x - top).exp()).sum();
                for (i, x) in s.iter().enumerate() {
                    if at.coded(i, n) {
                        mass[(w0 + i) * nkv + kv] += (x - top).exp() / z;
                    }
                }
            }
            mass
        })
        .reduce(zero, |mut a, b| {
            a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
            a
        });
    Ok(mass)
}

/// Rows `[tokens, kv heads, d]` (as many as `rows` has) in which kv head `h`'s row `i` is one of
/// its own rows of `rows`, drawn from a mixture: a fraction `by_mass` in proportion to `mass`
/// (`[tokens, kv heads]`), the rest uniformly. Systematic resampling with offset `offset` in
/// `[0, 1)`: a row of probability `p` is drawn ⌊np⌋ or ⌈np⌉ times out of `n`. A head whose rows
/// received no mass draws uniformly.
pub fn draw_rows(rows: &[f32], mass: &[f64], kv: usize, d: usize, by_mass: f64, offset: f64) -> Result<Vec<f32>> {
    if kv == 0 || d == 0 || !rows.len().is_multiple_of(kv * d) || mass.len() * d != rows.len() {
        return Err(Error::Shape(format!(
            "{} values and {} masses are not rows of {kv} heads × {d}",
            rows.len(),
            mass.len()
        )));
    }
    if !(0.0..=1.0).contains(&by_mass) || !(0.0..1.0).contains(&offset) {
        return Err(Error::Config(format!("a fraction {by_mass} and an offset {offset} in [0, 1]")));
    }
    let n = rows.len() / (kv * d);
    let mut out = vec![0.0f32; rows.len()];
    for h in 0..kv {
        let total: f64 = (0..n).map(|t| mass[t * kv + h]).sum();
        let mix = if total > 0.0 { by_mass } else { 0.0 };
        let p = |t: usize| mix * mass[t * kv + h] / total.max(f64::MIN_POSITIVE) + (1.0 - mix) / n as f64;
        let (mut t, mut upto) = (0, p(0));
        for i in 0..n {
            let u = (i as f64 + offset) / n as f64;
            while u >= upto && t + 1 < n {
                t += 1;
                upto += p(t);
            }
            out[(i * kv + h) * d..(i * kv + h + 1) * d].copy_from_slice(&rows[(t * kv + h) * d..(t * kv + h + 1) * d]);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{fresh_seed, normal, rng};
    use rand::Rng;

    /// With every position coded each sampled query hands out its whole softmax, so a kv head's
    /// mass sums to its sampled queries times its group; with a recent window as long as a pass
    /// nothing is coded and nothing counts. Past the last sampled query no position gets any.
    #[test]
    fn mass_is_the_softmax_over_coded_positions() {
        let mut r = rng(fresh_seed());
        let (keys, queries) = (normal(&mut r, 90 * 2 * 8, 1.0), normal(&mut r, 90 * 6 * 8, 3.0));
        let all = QuerySampling { window: 40, stride: 7, skip: 5, sink: 0, recent: 0 };
        // Passes 0–39, 40–79, 80–89; queries at 5, 12, …, 33 (5 a pass), and 85 in the last.
        assert_eq!(all.queries(90).len(), 11);
        let queries = all.gather(&queries, 6 * 8);
        assert_eq!(queries.len(), 11 * 6 * 8);
        let rows = AttentionRows { keys: &keys, queries: &queries, scale: 0.35, heads: 6, kv_heads: 2, head_dim: 8 };
        let mass = coded_mass(rows, all).unwrap();
        for kv in 0..2 {
            let sum: f64 = (0..90).map(|t| mass[t * 2 + kv]).sum();
            assert!((sum - 11.0 * 3.0).abs() < 1e-9, "kv {kv}: {sum}");
        }
        assert!(mass.iter().all(|&m| m >= 0.0));
        assert!((34..40).chain(86..90).all(|t| mass[t * 2] == 0.0 && mass[t * 2 + 1] == 0.0));
        let none = QuerySampling { recent: 40, ..all };
        assert!(coded_mass(rows, none).unwrap().iter().all(|&m| m == 0.0));
        // A sink of 2: its positions never count, and the rest hold less than everything.
        let m = coded_mass(rows, QuerySampling { sink: 2, ..all }).unwrap();
        assert!([0, 1, 40, 41, 80, 81].iter().all(|&t| m[t * 2] == 0.0 && m[t * 2 + 1] == 0.0));
        assert!(m.iter().sum::<f64>() < mass.iter().sum::<f64>());
        let short = AttentionRows { queries: &queries[..8], ..rows };
        assert!(coded_mass(short, all).is_err(), "queries not recorded");
        assert!(coded_mass(AttentionRows { queries: &[], heads: 0, ..rows }, all).is_err(), "no query heads");
    }

    /// A recorder keeping, pass by pass, the positions `samples` accepts holds exactly the rows
    /// `queries` lists, in its order, and `gather` picks those rows out of every position's.
    #[test]
    fn a_recorder_keeps_the_sampled_rows() {
        let mut r = rng(fresh_seed());
        for _ in 0..20 {
            let window = r.random_range(1..50usize);
            let at = QuerySampling {
                window,
                stride: r.random_range(1..9),
                skip: r.random_range(0..window + 2),
                sink: 0,
                recent: 0,
            };
            let tokens = r.random_range(1..130usize);
            let kept: Vec<(usize, usize)> = (0..tokens)
                .step_by(window)
                .flat_map(|w0| {
                    (w0..(w0 + window).min(tokens)).filter(move |&t| at.samples(t - w0)).map(move |t| (w0, t))
                })
                .collect();
            assert_eq!(kept, at.queries(tokens), "{at:?} over {tokens}");
            // Row t of every position's queries is filled with t.
            let all: Vec<f32> = (0..tokens).flat_map(|t| [t as f32; 3]).collect();
            let want: Vec<f32> = kept.iter().flat_map(|&(_, t)| [t as f32; 3]).collect();
            assert_eq!(at.gather(&all, 3), want);
        }
    }

    /// Systematic resampling draws each row ⌊np⌋ or ⌈np⌉ times (counted against the mixture's
    /// probabilities), each head from its own rows; uniformly, each row exactly once and in order.
    #[test]
    fn draws_follow_the_mixture() {
        let mut r = rng(fresh_seed());
        let (n, kv, d) = (300usize, 2usize, 4usize);
        // Row t of head h is filled with t * kv + h, so a drawn row names itself.
        let rows: Vec<f32> = (0..n * kv).flat_map(|r| vec![r as f32; d]).collect();
        let mass: Vec<f64> = (0..n * kv).map(|_| (r.random::<f64>() * 4.0).exp()).collect();
        let offset: f64 = r.random();
        assert_eq!(draw_rows(&rows, &mass, kv, d, 0.0, offset).unwrap(), rows);
        assert_eq!(draw_rows(&rows, &vec![0.0; n * kv], kv, d, 1.0, offset).unwrap(), rows, "no mass: uniform");
        for by_mass in [0.5, 1.0] {
            let drawn = draw_rows(&rows, &mass, kv, d, by_mass, offset).unwrap();
            for h in 0..kv {
                let total: f64 = (0..n).map(|t| mass[t * kv + h]).sum();
                let mut count = vec![0usize; n];
                for i in 0..n {
                    let r = drawn[(i * kv + h) * d] as usize;
                    assert_eq!(r % kv, h, "head {h} drew another head's row");
                    assert!(drawn[(i * kv + h) * d..(i * kv + h + 1) * d].iter().all(|&x| x == r as f32));
                    count[r / kv] += 1;
                }
                for (t, &c) in count.iter().enumerate() {
                    let np = n as f64 * (by_mass * mass[t * kv + h] / total + (1.0 - by_mass) / n as f64);
                    assert!(c as f64 >= np.floor() - 1e-9 && c as f64 <= np.ceil() + 1e-9, "row {t}: {c} of {np}");
                }
            }
        }
        assert!(draw_rows(&rows[..5], &mass, kv, d, 1.0, offset).is_err());
        assert!(draw_rows(&rows, &mass, kv, d, 1.5, offset).is_err());
    }

    #[test]
    fn names_round_trip() {
        for w in [ValueWeights::Uniform, ValueWeights::Attention] {
            assert_eq!(w.name().parse::<ValueWeights>().unwrap(), w);
        }
        assert!("mass".parse::<ValueWeights>().is_err());
    }
}
