//! Candidate codebooks kept between runs, beside the methods' calibrations (`<cache dir>/eval`):
//! a candidate that trains books on the calibration text (`--turning-keys`, `--value-mass`) trains
//! them once, and a grid on a borrowed GPU reads books trained here instead of recording the
//! text and running k-means on the device's CPU.
//!
//! A set of books is stored as a calibration artifact (its key and value codecs per layer: the
//! candidate's own on the side it trains, the method's on the other) plus, for books that need
//! them, per-layer vectors in a second safetensors file. It is reused only for the same model
//! file, method, calibration text, seed and window.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};

use veloq::artifact::{Calibration, LayerCodecs};
use veloq::codec::vecinfer::VecInferCodec;

/// Where candidate books live, for one model file.
#[derive(Clone, Debug)]
pub struct BookCache {
    dir: PathBuf,
    stem: String,
}

/// One candidate's books for every layer.
#[derive(Clone, Debug, PartialEq)]
pub struct Books {
    /// Key codecs per layer.
    pub keys: Vec<VecInferCodec>,
    /// Value codecs per layer.
    pub values: Vec<VecInferCodec>,
    /// Per layer, vectors the candidate needs beside its books (empty when none).
    pub vectors: Vec<Vec<f32>>,
}

impl BookCache {
    /// Books for the model at `model_path` under `cache_dir`/eval.
    pub fn new(cache_dir: &Path, model_path: &Path) -> Result<Self> {
        let dir = cache_dir.join("eval");
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let stem = model_path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        Ok(Self { dir, stem })
    }

    /// The artifact of books `what` (e.g. `turning32`) trained for `cal`'s method on its text in
    /// `window`-position passes with k-means seed `seed`.
    pub fn path(&self, cal: &Calibration, window: usize, seed: u64, what: &str) -> PathBuf {
        let method = crate::calibrations::fnv(&format!("{:?}{:?}", cal.keys, cal.values));
        self.dir.join(format!(
            "{}.{method:016x}.s{seed}.t{}.w{window}.{what}.safetensors",
            self.stem, cal.calibration_tokens
        ))
    }

    fn vectors_path(path: &Path) -> PathBuf {
        path.with_extension("vectors.safetensors")
    }

    /// Books an earlier run saved for the same method, text, seed and window, if any (a file
    /// that does not read back or was trained on other text is not used).
    pub fn load(&self, cal: &Calibration, window: usize, seed: u64, what: &str) -> Option<Books> {
        let path = self.path(cal, window, seed, what);
        let saved = Calibration::load_for(&path, &cal.model).ok()?;
        let same = saved.text == cal.text && saved.seed == seed && saved.keys == cal.keys && saved.values == cal.values;
        if !same {
            return None;
        }
        let vectors = match Self::vectors_path(&path) {
            p if p.exists() => {
                let mut t: HashMap<String, Tensor> = candle_core::safetensors::load(&p, &Device::Cpu).ok()?;
                (0..saved.layers.len())
                    .map(|l| t.remove(&format!("layer.{l}"))?.to_vec1::<f32>().ok())
                    .collect::<Option<Vec<_>>>()?
            }
            _ => Vec::new(),
        };
        let (keys, values) = saved.layers.into_iter().map(|l| (l.keys, l.values)).unzip();
        Some(Books { keys, values, vectors })
    }

    /// Saves `books`, trained for `cal`'s method as [`load`](Self::load) finds them.
    pub fn save(&self, cal: &Calibration, window: usize, seed: u64, what: &str, books: &Books) -> Result<()> {
        let path = self.path(cal, window, seed, what);
        let layers =
            books.keys.iter().zip(&books.values).map(|(k, v)| LayerCodecs { keys: k.clone(), values: v.clone() });
        let set =
            Calibration::new(cal.model.clone(), cal.keys, cal.values, seed, cal.calibration_tokens, layers.collect())
                .context("candidate books")?
                .with_text(cal.text.clone());
        set.save(&path).with_context(|| format!("saving {}", path.display()))?;
        let vectors = Self::vectors_path(&path);
        if books.vectors.is_empty() {
            let _ = std::fs::remove_file(&vectors);
            return Ok(());
        }
        let tensors = books
            .vectors
            .iter()
            .enumerate()
            .map(|(l, v)| Ok((format!("layer.{l}"), Tensor::from_slice(v, v.len(), &Device::Cpu)?)))
            .collect::<Result<HashMap<_, _>>>()?;
        candle_core::safetensors::save(&tensors, &vectors).with_context(|| format!("saving {}", vectors.display()))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use veloq::artifact::ModelIdentity;
    use veloq::codec::codebook::PqShape;
    use veloq::codec::vecinfer::CodecSpec;

    fn calibration(rng: &mut crate::synthetic::Rng, tokens: usize) -> Calibration {
        let (heads, d, layers) = (2, 16, 2);
        let spec = CodecSpec::keys(PqShape::new(4, 4).unwrap());
        let model = ModelIdentity {
            name: "tiny".into(),
            architecture: "llama".into(),
            n_layers: layers,
            n_kv_heads: heads,
            head_dim: d,
        };
        let layer = |rng: &mut crate::synthetic::Rng| LayerCodecs {
            keys: crate::synthetic::codec(rng, heads, d, &spec).unwrap(),
            values: crate::synthetic::codec(rng, heads, d, &spec).unwrap(),
        };
        let layers = (0..layers).map(|_| layer(rng)).collect();
        Calibration::new(model, spec, spec, 3, tokens, layers).unwrap()
    }

    /// Saved books read back equal, vectors included; another seed, window, text or candidate
    /// finds none.
    #[test]
    fn books_read_back_only_for_what_trained_them() {
        let mut rng = crate::synthetic::Rng(crate::testing::fresh_seed() | 1);
        let dir = std::env::temp_dir().join(format!("veloq-books-{}", crate::testing::fresh_seed()));
        let cache = BookCache::new(&dir, Path::new("/models/tiny.gguf")).unwrap();
        let cal = calibration(&mut rng, 64);
        let other = calibration(&mut rng, 64);
        let books = Books {
            keys: other.layers.iter().map(|l| l.keys.clone()).collect(),
            values: cal.layers.iter().map(|l| l.values.clone()).collect(),
            vectors: (0..2).map(|_| (0..32).map(|_| rng.normal()).collect()).collect(),
        };
        assert!(cache.load(&cal, 32, 3, "turning8").is_none(), "nothing before a save");
        cache.save(&cal, 32, 3, "turning8", &books).unwrap();
        assert_eq!(cache.load(&cal, 32, 3, "turning8"), Some(books.clone()));
        assert!(cache.load(&cal, 32, 4, "turning8").is_none(), "another seed");
        assert!(cache.load(&cal, 64, 3, "turning8").is_none(), "another window");
        assert!(cache.load(&cal, 32, 3, "turning4").is_none(), "another candidate");
        let mut read_elsewhere = cal.clone();
        read_elsewhere.text = veloq::calibrate::TextFingerprint::of_tokens(&(0..512).collect::<Vec<u32>>());
        assert_ne!(read_elsewhere.text, cal.text);
        assert!(cache.load(&read_elsewhere, 32, 3, "turning8").is_none(), "another text");
        // Books without vectors leave none behind from an earlier save.
        let plain = Books { vectors: Vec::new(), ..books };
        cache.save(&cal, 32, 3, "turning8", &plain).unwrap();
        assert_eq!(cache.load(&cal, 32, 3, "turning8"), Some(plain));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
