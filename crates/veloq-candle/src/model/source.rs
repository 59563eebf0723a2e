//! Where a model's metadata and weights come from: a GGUF file, or tensors built in memory (random
//! weights of a real geometry for speed measurements, tiny models for tests). The decoder loads
//! from either through the same code.

use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use candle_core::quantized::{gguf_file, QTensor};
use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};

/// A model's metadata (GGUF keys and values) and its tensors by GGUF name.
pub trait ModelSource {
    /// The metadata: `general.architecture`, `<arch>.block_count`, tokenizer keys…
    fn metadata(&self) -> &HashMap<String, gguf_file::Value>;
    /// Tensor `name` on `device`, `None` when the source has no tensor of that name.
    fn tensor(&mut self, name: &str, device: &Device) -> Result<Option<Weight>>;
    /// What errors name as the model (a path, or a label).
    fn origin(&self) -> PathBuf;
}

/// A GGUF file, its metadata read, its tensors read when asked for.
pub struct GgufFile {
    path: PathBuf,
    content: gguf_file::Content,
    reader: BufReader<File>,
}

impl GgufFile {
    /// Opens `path` and reads its header; a file that is not GGUF is an [`Error::Model`].
    pub fn open(path: &Path) -> Result<Self> {
        let bad = |reason: String| Error::Model { path: path.to_path_buf(), reason };
        let file = File::open(path).map_err(|e| bad(e.to_string()))?;
        let mut reader = BufReader::new(file);
        let content = gguf_file::Content::read(&mut reader)
            .map_err(|e| bad(format!("not a readable GGUF file (truncated or corrupt?): {e}")))?;
        Ok(Self { path: path.to_path_buf(), content, reader })
    }

    /// The parsed header (the tokenizer is built from it).
    pub fn content(&self) -> &gguf_file::Content {
        &self.content
    }
}

impl ModelSource for GgufFile {
    fn metadata(&self) -> &HashMap<String, gguf_file::Value> {
        &self.content.metadata
    }

    fn tensor(&mut self, name: &str, device: &Device) -> Result<Option<Weight>> {
        if !self.content.tensor_infos.contains_key(name) {
            return Ok(None);
        }
        self.content
            .tensor(&mut self.reader, name, device)
            .map(|q| Some(Weight::Quantized(q)))
            .map_err(|e| Error::Model { path: self.path.clone(), reason: format!("tensor {name}: {e}") })
    }

    fn origin(&self) -> PathBuf {
        self.path.clone()
    }
}

/// Metadata and tensors held in memory, named as in a GGUF file.
pub struct MemorySource {
    /// What errors call the model.
    pub label: String,
    /// GGUF metadata.
    pub metadata: HashMap<String, gguf_file::Value>,
    /// Tensors by GGUF name, on the device the model will run on.
    pub tensors: HashMap<String, Weight>,
}

impl ModelSource for MemorySource {
    fn metadata(&self) -> &HashMap<String, gguf_file::Value> {
        &self.metadata
    }

    fn tensor(&mut self, name: &str, device: &Device) -> Result<Option<Weight>> {
        match self.tensors.remove(name) {
            Some(w) if !w.device().same_device(device) => Err(Error::Model {
                path: self.origin(),
                reason: format!("tensor {name} is on {:?}, the model loads on {device:?}", w.device()),
            }),
            w => Ok(w),
        }
    }

    fn origin(&self) -> PathBuf {
        PathBuf::from(&self.label)
    }
}

/// One weight as a source holds it: GGUF blocks (any ggml type), or a plain tensor (random f16
/// weights built on the device). Held briefly while loading, so the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
pub enum Weight {
    /// As stored in a GGUF file.
    Quantized(QTensor),
    /// A tensor of any float type.
    Dense(Tensor),
}

impl Weight {
    /// Its device.
    pub fn device(&self) -> Device {
        match self {
            Weight::Quantized(q) => q.device(),
            Weight::Dense(t) => t.device().clone(),
        }
    }

    /// Its dimensions.
    pub fn dims(&self) -> &[usize] {
        match self {
            Weight::Quantized(q) => q.shape().dims(),
            Weight::Dense(t) => t.dims(),
        }
    }

    /// Its values as f32 on `device` (norms, biases, embeddings are small or gathered by row).
    pub fn to_f32(&self, device: &Device) -> Result<Tensor> {
        Ok(match self {
            Weight::Quantized(q) => q.dequantize(device)?,
            Weight::Dense(t) => t.to_device(device)?.to_dtype(DType::F32)?,
        })
    }
}
