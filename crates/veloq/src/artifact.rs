//! Calibration artifacts: smoothing scales and codebooks for every layer, plus the configuration
//! and the identity of the model they were trained on, in one safetensors file.
//!
//! Tensors (all F32): `layers.{i}.{keys|values}.mean` and `.smooth`, `[n_kv_heads, head_dim]`
//! (only when that side centers / smooths) and `layers.{i}.{keys|values}.codebooks` `[books, centroids, sub_dim]`.
//! Metadata: one key, `veloq`, holding a JSON object (a single key keeps the header bytes
//! deterministic, since safetensors stores metadata in a hash map).
//!
//! Loading trusts nothing: every tensor's presence, dtype, shape and finiteness is checked against
//! the metadata, and [`Calibration::load_for`] checks the metadata against the model in hand.

use std::collections::HashMap;
use std::path::Path;

use safetensors::{tensor::TensorView, Dtype, SafeTensors};
use serde::{Deserialize, Serialize};

use crate::calibrate::{TextFingerprint, ValueWeights};
use crate::codec::block::BlockCodec;
use crate::codec::codebook::{Codebook, CodebookSet, Granularity, PqShape};
use crate::codec::smooth::{SmoothRule, SmoothScales, MIN_SCALE};
use crate::codec::vecinfer::{CodecSpec, VecInferCodec};
use crate::error::{Error, Result};

/// The `format` field of every artifact.
pub const FORMAT: &str = "veloq.vecinfer";
/// Artifacts this version reads and writes.
pub const FORMAT_VERSION: u32 = 1;

/// What a calibration was made for: the model's name and the geometry its codecs depend on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelIdentity {
    /// `general.name` (or the file's stem).
    pub name: String,
    /// GGUF `general.architecture`.
    pub architecture: String,
    /// Decoder blocks.
    pub n_layers: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// Channels per head.
    pub head_dim: usize,
}

impl ModelIdentity {
    /// FNV-1a of the geometry: a cheap check that metadata was not edited by hand.
    pub fn geometry_hash(&self) -> String {
        let text = format!("{}/{}/{}/{}", self.architecture, self.n_layers, self.n_kv_heads, self.head_dim);
        let mut h: u64 = 0xcbf29ce484222325;
        for b in text.bytes() {
            h = (h ^ b as u64).wrapping_mul(0x100000001b3);
        }
        format!("{h:016x}")
    }

    fn describe(&self) -> String {
        format!(
            "{} ({}, {} layers, {} kv-heads, head_dim {})",
            self.name, self.architecture, self.n_layers, self.n_kv_heads, self.head_dim
        )
    }
}

/// The key and value codecs of one layer.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerCodecs {
    /// The keys' codec.
    pub keys: VecInferCodec,
    /// The values' codec.
    pub values: VecInferCodec,
}

/// A complete calibration for one model.
#[derive(Clone, Debug, PartialEq)]
pub struct Calibration {
    /// The model it was calibrated on.
    pub model: ModelIdentity,
    /// What the key codecs were trained as.
    pub keys: CodecSpec,
    /// What the value codecs were trained as.
    pub values: CodecSpec,
    /// k-means seed.
    pub seed: u64,
    /// Tokens of text the activations came from.
    pub calibration_tokens: usize,
    /// Shingles of the calibration text, so evaluation can refuse to run on it.
    pub text: TextFingerprint,
    /// What the value codebooks' k-means weighed each row by.
    pub value_weights: ValueWeights,
    /// Per layer, in layer order.
    pub layers: Vec<LayerCodecs>,
}

#[derive(Serialize, Deserialize)]
struct SideMeta {
    sub_dim: usize,
    bits: u32,
    granularity: String,
    #[serde(default)]
    center: bool,
    smooth: Option<String>,
    rotate: bool,
}

#[derive(Serialize, Deserialize)]
struct Meta {
    format: String,
    format_version: u32,
    model: ModelIdentity,
    geometry_hash: String,
    keys: SideMeta,
    values: SideMeta,
    seed: u64,
    calibration_tokens: usize,
    #[serde(default)]
    text: TextFingerprint,
    /// Absent for uniform weights (artifacts from before the option read as uniform).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    value_weights: Option<String>,
}

impl SideMeta {
    fn from_spec(s: &CodecSpec) -> Self {
        Self {
            sub_dim: s.shape.sub_dim,
            bits: s.shape.bits,
            granularity: s.granularity.name().into(),
            center: s.center,
            smooth: s.smooth.map(|r| r.name().into()),
            rotate: s.rotate,
        }
    }
    fn to_spec(&self) -> Result<CodecSpec> {
        Ok(CodecSpec {
            shape: PqShape::new(self.sub_dim, self.bits)?,
            granularity: Granularity::parse(&self.granularity)?,
            center: self.center,
            smooth: self.smooth.as_deref().map(SmoothRule::parse).transpose()?,
            rotate: self.rotate,
        })
    }
}

fn side_name(keys: bool) -> &'static str {
    if keys {
        "keys"
    } else {
        "values"
    }
}

impl Calibration {
    /// Checks that the layers match the model geometry and the specs.
    pub fn new(
        model: ModelIdentity,
        keys: CodecSpec,
        values: CodecSpec,
        seed: u64,
        calibration_tokens: usize,
        layers: Vec<LayerCodecs>,
    ) -> Result<Self> {
        if layers.len() != model.n_layers {
            return Err(Error::Shape(format!(
                "{} layer codecs for a model of {} layers",
                layers.len(),
                model.n_layers
            )));
        }
        for (i, l) in layers.iter().enumerate() {
            for (codec, spec, k) in [(&l.keys, &keys, true), (&l.values, &values, false)] {
                let ok = codec.n_heads() == model.n_kv_heads
                    && codec.head_dim() == model.head_dim
                    && codec.shape() == spec.shape
                    && codec.books().granularity() == spec.granularity
                    && codec.smooth().is_some() == spec.smooth.is_some()
                    && codec.mean().is_some() == spec.center
                    && codec.rotates() == spec.rotate;
                if !ok {
                    return Err(Error::Shape(format!(
                        "layer {i} {} codec does not match the model geometry or its spec",
                        side_name(k)
                    )));
                }
            }
        }
        Ok(Self {
            model,
            keys,
            values,
            seed,
            calibration_tokens,
            text: TextFingerprint::default(),
            value_weights: ValueWeights::Uniform,
            layers,
        })
    }

    /// Records what the value codebooks' k-means weighed rows by.
    pub fn with_value_weights(mut self, weights: ValueWeights) -> Self {
        self.value_weights = weights;
        self
    }

    /// Records which text the calibration saw.
    pub fn with_text(mut self, text: TextFingerprint) -> Self {
        self.text = text;
        self
    }

    /// The serialized artifact. Same calibration, same bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let meta = Meta {
            format: FORMAT.into(),
            format_version: FORMAT_VERSION,
            model: self.model.clone(),
            geometry_hash: self.model.geometry_hash(),
            keys: SideMeta::from_spec(&self.keys),
            values: SideMeta::from_spec(&self.values),
            seed: self.seed,
            calibration_tokens: self.calibration_tokens,
            text: self.text.clone(),
            value_weights: (self.value_weights != ValueWeights::Uniform).then(|| self.value_weights.name().into()),
        };
        let mut owned: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
        for (i, l) in self.layers.iter().enumerate() {
            for (codec, k) in [(&l.keys, true), (&l.values, false)] {
                let p = format!("layers.{i}.{}", side_name(k));
                if let Some(m) = codec.mean() {
                    owned.push((format!("{p}.mean"), vec![codec.n_heads(), codec.head_dim()], f32_bytes(m)));
                }
                if let Some(s) = codec.smooth() {
                    owned.push((format!("{p}.smooth"), vec![s.n_heads(), s.head_dim()], f32_bytes(s.as_slice())));
                }
                let books = codec.books();
                let data: Vec<f32> = books.books().iter().flat_map(|b| b.centroids().iter().copied()).collect();
                let shape = vec![books.books().len(), books.shape().centroids(), books.shape().sub_dim];
                owned.push((format!("{p}.codebooks"), shape, f32_bytes(&data)));
            }
        }
        let views = owned
            .iter()
            .map(|(n, s, d)| {
                Ok((n.clone(), TensorView::new(Dtype::F32, s.clone(), d).map_err(|e| Error::Shape(e.to_string()))?))
            })
            .collect::<Result<Vec<_>>>()?;
        let json = serde_json::to_string(&meta).expect("metadata serializes");
        safetensors::serialize(views, Some(HashMap::from([("veloq".to_string(), json)])))
            .map_err(|e| Error::Shape(e.to_string()))
    }

    /// Writes the artifact atomically (temporary file, then rename), so a failed write never
    /// leaves a half-written calibration behind.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let bytes = self.to_bytes()?;
        let tmp = path.with_extension("safetensors.tmp");
        let io = |source| Error::Io { path: path.to_path_buf(), source };
        std::fs::write(&tmp, &bytes).map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    }

    /// Reads and validates an artifact.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        Self::from_bytes(&bytes, path)
    }

    /// Reads an artifact and checks it was made for `model` (architecture and geometry; the name
    /// may differ, e.g. another quantization of the same weights).
    pub fn load_for(path: impl AsRef<Path>, model: &ModelIdentity) -> Result<Self> {
        let cal = Self::load(path.as_ref())?;
        let (a, b) = (&cal.model, model);
        if a.architecture != b.architecture
            || a.n_layers != b.n_layers
            || a.n_kv_heads != b.n_kv_heads
            || a.head_dim != b.head_dim
        {
            return Err(Error::Artifact {
                path: path.as_ref().to_path_buf(),
                reason: format!("calibrated for {}, but the model is {}", a.describe(), b.describe()),
            });
        }
        Ok(cal)
    }

    /// Parses and validates artifact bytes; `path` only names the file in errors.
    pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<Self> {
        let bad = |reason: String| Error::Artifact { path: path.to_path_buf(), reason };
        let st = SafeTensors::deserialize(bytes)
            .map_err(|e| bad(format!("not a readable safetensors file (truncated or corrupt?): {e}")))?;
        let (_, header) = SafeTensors::read_metadata(bytes).map_err(|e| bad(format!("unreadable header: {e}")))?;
        let json = header
            .metadata()
            .as_ref()
            .and_then(|m| m.get("veloq"))
            .ok_or_else(|| bad("no veloq metadata: not a veloq calibration".into()))?;
        let meta: Meta = serde_json::from_str(json).map_err(|e| bad(format!("metadata: {e}")))?;
        if meta.format != FORMAT || meta.format_version != FORMAT_VERSION {
            return Err(bad(format!(
                "format {} v{} (this veloq reads {FORMAT} v{FORMAT_VERSION})",
                meta.format, meta.format_version
            )));
        }
        if meta.geometry_hash != meta.model.geometry_hash() {
            return Err(bad("geometry hash does not match the recorded geometry (edited metadata?)".into()));
        }
        let m = &meta.model;
        if m.n_layers == 0 || m.n_kv_heads == 0 || m.head_dim == 0 {
            return Err(bad(format!(
                "empty geometry: {} layers, {} kv-heads, head_dim {}",
                m.n_layers, m.n_kv_heads, m.head_dim
            )));
        }
        let wrap = |e: Error| bad(e.to_string());
        let keys = meta.keys.to_spec().map_err(wrap)?;
        let values = meta.values.to_spec().map_err(wrap)?;
        let mut expected = 0;
        let mut layers = Vec::with_capacity(m.n_layers);
        for i in 0..m.n_layers {
            let mut side = |spec: &CodecSpec, k: bool| -> Result<VecInferCodec> {
                let p = format!("layers.{i}.{}", side_name(k));
                let mean = if spec.center {
                    expected += 1;
                    Some(read_f32(&st, &format!("{p}.mean"), &[m.n_kv_heads, m.head_dim]).map_err(bad)?)
                } else {
                    None
                };
                let smooth = match spec.smooth {
                    Some(_) => {
                        expected += 1;
                        let data = read_f32(&st, &format!("{p}.smooth"), &[m.n_kv_heads, m.head_dim]).map_err(bad)?;
                        if let Some(j) = data.iter().position(|&s| s < MIN_SCALE) {
                            return Err(bad(format!("{p}.smooth[{j}] = {} is below {MIN_SCALE}", data[j])));
                        }
                        Some(SmoothScales::new(m.n_kv_heads, m.head_dim, data).map_err(wrap)?)
                    }
                    None => None,
                };
                let subspaces = spec.shape.subspaces(m.head_dim).map_err(wrap)?;
                let count = if spec.granularity == Granularity::PerLayer { 1 } else { subspaces };
                expected += 1;
                let (k_, sd) = (spec.shape.centroids(), spec.shape.sub_dim);
                let data = read_f32(&st, &format!("{p}.codebooks"), &[count, k_, sd]).map_err(bad)?;
                let books = data
                    .chunks_exact(k_ * sd)
                    .map(|c| Codebook::new(sd, c.to_vec()))
                    .collect::<Result<Vec<_>>>()
                    .map_err(wrap)?;
                let books = CodebookSet::new(spec.shape, spec.granularity, subspaces, books).map_err(wrap)?;
                VecInferCodec::new(m.n_kv_heads, m.head_dim, mean, smooth, spec.rotate, books).map_err(wrap)
            };
            let keys_codec = side(&keys, true)?;
            let values_codec = side(&values, false)?;
            layers.push(LayerCodecs { keys: keys_codec, values: values_codec });
        }
        if st.len() != expected {
            let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
            names.sort();
            return Err(bad(format!("{} tensors where the metadata implies {expected}: {names:?}", st.len())));
        }
        let weights = meta.value_weights.as_deref().map_or(Ok(ValueWeights::Uniform), str::parse).map_err(wrap)?;
        let cal = Self::new(meta.model, keys, values, meta.seed, meta.calibration_tokens, layers).map_err(wrap)?;
        Ok(cal.with_text(meta.text).with_value_weights(weights))
    }

    /// Bits per element of keys and values including every stored byte of codebooks and scales,
    /// amortised over `tokens` tokens.
    pub fn bits_per_element(&self, tokens: usize) -> f64 {
        let m = &self.model;
        let elements = (2 * tokens * m.n_layers * m.n_kv_heads * m.head_dim) as f64;
        let mut bytes = 0usize;
        for l in &self.layers {
            for c in [&l.keys, &l.values] {
                bytes += c.code_bytes(tokens) + BlockCodec::resident_bytes(c);
            }
        }
        8.0 * bytes as f64 / elements
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Reads tensor `name` as F32 of exactly `shape`, all finite.
fn read_f32(st: &SafeTensors, name: &str, shape: &[usize]) -> std::result::Result<Vec<f32>, String> {
    let t = st.tensor(name).map_err(|_| format!("missing tensor {name}"))?;
    if t.dtype() != Dtype::F32 {
        return Err(format!("tensor {name} has dtype {:?}, expected F32", t.dtype()));
    }
    if t.shape() != shape {
        return Err(format!("tensor {name} has shape {:?}, expected {shape:?}", t.shape()));
    }
    let data: Vec<f32> = t.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    if let Some(i) = data.iter().position(|v| !v.is_finite()) {
        return Err(format!("tensor {name} holds a non-finite value ({}) at index {i}", data[i]));
    }
    Ok(data)
}

#[cfg(test)]
mod tests;
