//! The one vocabulary for cache methods, the same on the command line, in the server's options, in
//! the lab's tables and in the Python binding. A name says the bits per element of the coded
//! stream:
//!
//! - `fp16` — uncompressed f16 keys and values;
//! - `vq-4`, `vq-2`, `vq-1.5`… — VecInfer product VQ at that many bits per element for keys and
//!   values; `vq-k4v2` gives keys and values their own rate. A rate names its codebook shape
//!   (8-bit codebooks where one fits: 4 bits = 256 centroids of 2 channels, 2 bits = 256 of 4,
//!   1 bit = 256 of 8; else the widest sub-vector whose codebook has at most 12 bits: 3 bits =
//!   4,096 centroids of 4); `s2b6` spells a shape out (sub-vectors of 2, 6-bit codebooks: 3
//!   bits);
//! - `kivi-2`, `kivi-4` — KIVI scalar codes (keys per channel, values per token, groups of 32;
//!   `/g64` for other groups), plus two f16 scales per group;
//! - `rlm-4` — random-sign Hadamard rotation + Gaussian Lloyd–Max levels, plus one f16 scale per
//!   row.
//!
//! VecInfer ablations append modifiers: `/per-subspace` (a codebook per sub-space),
//! `/no-center`, `/center-k`, `/center-v` (which sides subtract the calibrated mean),
//! `/no-smooth`, `/max-abs`, `/query` (key smoothing rule; `√max|k|` by default), `/no-rotate`,
//! `/plain` (no centering, smoothing or rotation), `/no-sink` (no f16 attention sinks).

use std::fmt;
use std::str::FromStr;

use veloq::artifact::Calibration;
use veloq::codec::codebook::{Granularity, PqShape};
use veloq::codec::smooth::SmoothRule;
use veloq::codec::vecinfer::CodecSpec;

use crate::error::{Error, Result};

/// A cache method: what a cache stores per position.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Method {
    /// f16 keys and values (the reference).
    Fp16,
    /// VecInfer codes; needs a calibration of these specs for the model.
    VecInfer(Vq),
    /// KIVI-style asymmetric scalar quantization: keys per channel over `group` tokens, values per
    /// token over `group` channels.
    Kivi {
        /// Bits per code (1–8).
        bits: u32,
        /// Group length.
        group: usize,
    },
    /// Calibration-free randomised Hadamard rotation + Gaussian Lloyd–Max levels.
    RotLloydMax {
        /// Bits per code (1–8).
        bits: u32,
    },
}

/// What a VecInfer method codes with: the key and value codecs' specs (a calibration trains
/// codebooks for them) and whether the first positions stay f16.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Vq {
    /// Keys' codec.
    pub keys: CodecSpec,
    /// Values' codec.
    pub values: CodecSpec,
    /// The first positions stay f16 (attention sinks).
    pub sink: bool,
}

impl Default for Method {
    /// `vq-4`: the cheapest VecInfer rate whose retrieval equals fp16's on the needle grid.
    fn default() -> Self {
        Method::vq(4.0).expect("a 4-bit shape")
    }
}

impl Method {
    /// The VecInfer method of `bits` per element for keys and values, default specs.
    pub fn vq(bits: f64) -> Result<Self> {
        let shape = canonical_shape(bits)?;
        Ok(Method::VecInfer(Vq { keys: CodecSpec::keys(shape), values: CodecSpec::values(shape), sink: true }))
    }

    /// The VecInfer method a calibration was trained for (sinks on).
    pub fn of_calibration(cal: &Calibration) -> Self {
        Method::VecInfer(Vq { keys: cal.keys, values: cal.values, sink: true })
    }

    /// Whether a calibration must come with it.
    pub fn needs_calibration(&self) -> bool {
        matches!(self, Method::VecInfer(_))
    }

    /// Nominal bits per element of the coded stream, metadata per group or row included, tables
    /// shared by every position (codebooks) not: 16 for fp16. `head_dim` matters for the
    /// per-row scale of rotation + Lloyd–Max.
    pub fn bits_per_element(&self, head_dim: usize) -> f64 {
        match self {
            Method::Fp16 => 16.0,
            Method::VecInfer(v) => (v.keys.shape.bits_per_element() + v.values.shape.bits_per_element()) / 2.0,
            Method::Kivi { bits, group } => *bits as f64 + 32.0 / *group as f64,
            Method::RotLloydMax { bits } => *bits as f64 + 16.0 / head_dim as f64,
        }
    }

    /// A line for tables and `--help`: what is stored, at how many bits.
    pub fn describe(&self, head_dim: usize) -> String {
        let bits = self.bits_per_element(head_dim);
        match self {
            Method::Fp16 => "f16 keys and values, 16 bits".into(),
            Method::VecInfer(v) => {
                format!("VecInfer: keys {}, values {}; {bits:.2} bits per element", side(&v.keys), side(&v.values))
            }
            Method::Kivi { bits: b, group } => {
                format!("KIVI: {b}-bit codes, groups of {group} with f16 min and step; {bits:.2} bits per element")
            }
            Method::RotLloydMax { bits: b } => {
                format!("rotation + Lloyd–Max: {b}-bit levels, one f16 scale per row; {bits:.2} bits per element")
            }
        }
    }

    /// The method names a listing shows (the lab's tables: every rate, the mixed ones, the
    /// ablations, the baselines).
    pub fn catalogue() -> Vec<Method> {
        [
            "fp16",
            "vq-1",
            "vq-1.5",
            "vq-2",
            "vq-3",
            "vq-4",
            "vq-k4v2",
            "vq-k2v4",
            "vq-k3v2",
            "vq-k4v1",
            "vq-2/query",
            "vq-k3v2/query",
            "vq-k4v2/query",
            "vq-2/per-subspace",
            "vq-2/no-center",
            "vq-2/center-v",
            "vq-2/no-smooth",
            "vq-2/no-rotate",
            "vq-2/no-sink",
            "vq-2/plain",
            "kivi-2",
            "kivi-4",
            "rlm-2",
            "rlm-3",
            "rlm-4",
        ]
        .iter()
        .map(|s| s.parse().expect("catalogue names parse"))
        .collect()
    }

    /// The name with `/` spelled `+`, for file names (`vq-2+no-sink`).
    pub fn file_stem(&self) -> String {
        self.to_string().replace('/', "+")
    }
}

fn side(spec: &CodecSpec) -> String {
    format!("{} centroids of {} channels", spec.shape.centroids(), spec.shape.sub_dim)
}

/// The codebook shape a rate names: 8-bit codebooks where the rate allows, else the widest
/// sub-vector (of 2, 4, 8) whose codebook has 4 to 12 bits.
fn canonical_shape(bits: f64) -> Result<PqShape> {
    let shapes: Vec<PqShape> = [2usize, 4, 8]
        .iter()
        .filter_map(|&sub| {
            let cb = bits * sub as f64;
            (cb.fract() == 0.0 && (4.0..=12.0).contains(&cb)).then(|| PqShape::new(sub, cb as u32).ok()).flatten()
        })
        .collect();
    shapes.iter().find(|s| s.bits == 8).or(shapes.last()).copied().ok_or_else(|| {
        Error::Method(format!(
            "no codebook shape gives {bits} bits per element (sub-vectors of 2, 4 or 8, 4–12-bit codebooks)"
        ))
    })
}

/// A side's rate as a name writes it: the bits alone when they name this shape, else `s<sub>b<bits>`.
fn rate(shape: PqShape) -> String {
    let bits = shape.bits_per_element();
    match canonical_shape(bits) {
        Ok(c) if c == shape => fmt_bits(bits),
        _ => format!("s{}b{}", shape.sub_dim, shape.bits),
    }
}

fn fmt_bits(b: f64) -> String {
    if b.fract() == 0.0 {
        format!("{b:.0}")
    } else {
        let s = format!("{b:.3}");
        s.trim_end_matches('0').to_string()
    }
}

fn parse_rate(s: &str) -> Result<PqShape> {
    let bad = || Error::Method(format!("{s:?} is not a rate: bits per element (4, 1.5) or a shape (s2b6)"));
    if let Some(rest) = s.strip_prefix('s') {
        let (sub, bits) = rest.split_once('b').ok_or_else(bad)?;
        return Ok(PqShape::new(sub.parse().map_err(|_| bad())?, bits.parse().map_err(|_| bad())?)?);
    }
    let bits: f64 = s.parse().map_err(|_| bad())?;
    if !(bits.is_finite() && bits > 0.0) {
        return Err(bad());
    }
    canonical_shape(bits)
}

impl fmt::Display for Method {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Method::Fp16 => f.write_str("fp16"),
            Method::Kivi { bits, group } if *group == 32 => write!(f, "kivi-{bits}"),
            Method::Kivi { bits, group } => write!(f, "kivi-{bits}/g{group}"),
            Method::RotLloydMax { bits } => write!(f, "rlm-{bits}"),
            Method::VecInfer(v) => {
                let (k, val) = (rate(v.keys.shape), rate(v.values.shape));
                if k == val {
                    write!(f, "vq-{k}")?;
                } else {
                    write!(f, "vq-k{k}v{val}")?;
                }
                for m in modifiers(v) {
                    write!(f, "/{m}")?;
                }
                Ok(())
            }
        }
    }
}

/// The modifiers that turn the default specs into `v`'s, in the order names write them.
fn modifiers(v: &Vq) -> Vec<String> {
    let (k, val) = (&v.keys, &v.values);
    let mut out = Vec::new();
    match (k.granularity, val.granularity) {
        (Granularity::PerLayer, Granularity::PerLayer) => {}
        (Granularity::PerSubspace, Granularity::PerSubspace) => out.push("per-subspace".into()),
        (Granularity::PerSubspace, _) => out.push("per-subspace-k".into()),
        (_, Granularity::PerSubspace) => out.push("per-subspace-v".into()),
    }
    let plain = !k.center && !val.center && k.smooth.is_none() && !k.rotate && !val.rotate;
    if plain {
        out.push("plain".into());
    } else {
        match (k.center, val.center) {
            (true, true) => {}
            (false, false) => out.push("no-center".into()),
            (false, true) => out.push("center-v".into()),
            (true, false) => out.push("center-k".into()),
        }
        match k.smooth {
            Some(SmoothRule::SqrtMaxAbs) => {}
            Some(SmoothRule::MaxAbs) => out.push("max-abs".into()),
            Some(SmoothRule::QueryRms) => out.push("query".into()),
            None => out.push("no-smooth".into()),
        }
        match (k.rotate, val.rotate) {
            (true, true) => {}
            (false, false) => out.push("no-rotate".into()),
            (false, true) => out.push("no-rotate-k".into()),
            (true, false) => out.push("no-rotate-v".into()),
        }
    }
    if let Some(rule) = val.smooth {
        out.push(format!("smooth-v-{}", rule.name().replace('_', "-")));
    }
    if !v.sink {
        out.push("no-sink".into());
    }
    out
}

impl FromStr for Method {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let unknown = || {
            Error::Method(format!(
                "unknown method {s:?}: fp16, vq-<bits> (vq-4, vq-2, vq-1.5…), vq-k<bits>v<bits>, kivi-<bits>, rlm-<bits>"
            ))
        };
        let mut parts = s.trim().split('/');
        let base = parts.next().unwrap_or_default();
        let mods: Vec<&str> = parts.collect();
        let bits = |t: &str| -> Result<u32> {
            t.parse()
                .ok()
                .filter(|b| (1..=8).contains(b))
                .ok_or_else(|| Error::Method(format!("{s:?}: bits must be 1–8")))
        };
        if base == "fp16" && mods.is_empty() {
            return Ok(Method::Fp16);
        }
        if let Some(b) = base.strip_prefix("rlm-") {
            if !mods.is_empty() {
                return Err(unknown());
            }
            return Ok(Method::RotLloydMax { bits: bits(b)? });
        }
        if let Some(b) = base.strip_prefix("kivi-") {
            let group = match mods[..] {
                [] => 32,
                [g] => g.strip_prefix('g').and_then(|g| g.parse().ok()).filter(|&g| g > 0).ok_or_else(unknown)?,
                _ => return Err(unknown()),
            };
            return Ok(Method::Kivi { bits: bits(b)?, group });
        }
        let Some(rates) = base.strip_prefix("vq-") else { return Err(unknown()) };
        let (ks, vs) = match rates.strip_prefix('k').and_then(|r| r.split_once('v')) {
            Some((k, v)) => (parse_rate(k)?, parse_rate(v)?),
            None => {
                let r = parse_rate(rates)?;
                (r, r)
            }
        };
        let mut v = Vq { keys: CodecSpec::keys(ks), values: CodecSpec::values(vs), sink: true };
        for m in mods {
            let (k, val) = (&mut v.keys, &mut v.values);
            match m {
                "per-subspace" => {
                    (k.granularity, val.granularity) = (Granularity::PerSubspace, Granularity::PerSubspace)
                }
                "per-subspace-k" => k.granularity = Granularity::PerSubspace,
                "per-subspace-v" => val.granularity = Granularity::PerSubspace,
                "no-center" => (k.center, val.center) = (false, false),
                "center-v" => (k.center, val.center) = (false, true),
                "center-k" => (k.center, val.center) = (true, false),
                "no-smooth" => k.smooth = None,
                "max-abs" => k.smooth = Some(SmoothRule::MaxAbs),
                "query" => k.smooth = Some(SmoothRule::QueryRms),
                "no-rotate" => (k.rotate, val.rotate) = (false, false),
                "no-rotate-k" => k.rotate = false,
                "no-rotate-v" => val.rotate = false,
                "plain" => {
                    (k.center, val.center, k.smooth, k.rotate, val.rotate) = (false, false, None, false, false);
                }
                "no-sink" => v.sink = false,
                other => match other.strip_prefix("smooth-v-") {
                    Some(rule) => val.smooth = Some(SmoothRule::parse(&rule.replace('-', "_"))?),
                    None => return Err(Error::Method(format!("{s:?}: unknown modifier /{other}"))),
                },
            }
        }
        Ok(Method::VecInfer(v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_say_bits_and_round_trip() {
        let vq4: Method = "vq-4".parse().unwrap();
        let Method::VecInfer(v) = vq4 else { panic!() };
        assert_eq!((v.keys.shape.sub_dim, v.keys.shape.bits), (2, 8));
        assert_eq!(vq4, Method::default());
        assert_eq!(vq4.bits_per_element(64), 4.0);
        let shape = |s: &str| match s.parse::<Method>().unwrap() {
            Method::VecInfer(v) => {
                ((v.keys.shape.sub_dim, v.keys.shape.bits), (v.values.shape.sub_dim, v.values.shape.bits))
            }
            _ => panic!(),
        };
        assert_eq!(shape("vq-2"), ((4, 8), (4, 8)));
        assert_eq!(shape("vq-3"), ((4, 12), (4, 12)));
        assert_eq!(shape("vq-1.5"), ((8, 12), (8, 12)));
        assert_eq!(shape("vq-1"), ((8, 8), (8, 8)));
        assert_eq!(shape("vq-2.5"), ((4, 10), (4, 10)));
        assert_eq!(shape("vq-k4v2"), ((2, 8), (4, 8)));
        assert_eq!(shape("vq-s2b6"), ((2, 6), (2, 6)));
        assert_eq!("vq-k4v2".parse::<Method>().unwrap().bits_per_element(64), 3.0);
        assert_eq!("kivi-2".parse::<Method>().unwrap().bits_per_element(64), 3.0);
        for m in Method::catalogue() {
            assert_eq!(m.to_string().parse::<Method>().unwrap(), m, "{m}");
        }
        for name in
            ["vq-s2b6", "vq-k3v2/query", "vq-2/plain", "vq-2/center-k/no-rotate-v/no-sink", "kivi-3/g64", "rlm-1"]
        {
            assert_eq!(name.parse::<Method>().unwrap().to_string(), name);
        }
        assert_eq!("vq-2/no-center/no-smooth/no-rotate".parse::<Method>().unwrap().to_string(), "vq-2/plain");
        assert_eq!("vq-2/no-sink".parse::<Method>().unwrap().file_stem(), "vq-2+no-sink");
    }

    #[test]
    fn bad_names_say_what_is_wrong() {
        for (bad, says) in [
            ("vecinfer", "unknown method"),
            ("vq-0.3", "no codebook shape"),
            ("vq-7", "no codebook shape"),
            ("vq-2/fast", "unknown modifier"),
            ("kivi-9", "1–8"),
            ("rlm-2/g8", "unknown method"),
            ("vq-s3b8", "sub_dim"),
            ("vq-x", "not a rate"),
        ] {
            let e = bad.parse::<Method>().unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
