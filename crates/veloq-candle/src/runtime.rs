//! The front door every face of veloq stands on (the CLI, the server, the lab, the Python
//! binding): where a model runs ([`Device`]), how CUDA runs it ([`CudaOptions`]), and [`load`],
//! which opens a GGUF file with its tokenizer and the caches of a [`Method`](crate::Method) in one
//! call. Everything is passed in; the library reads no environment variable (binaries read theirs
//! at their edge and fill these structs).
//!
//! ```no_run
//! # fn main() -> veloq_candle::Result<()> {
//! use veloq_candle::generate::{generate, GenerateOptions};
//! use veloq_candle::runtime::{load, RunOptions};
//! let run = load("smollm2.gguf".as_ref(), &"vq-4".parse()?, Some("smollm2.vq-4.safetensors".as_ref()), &RunOptions::default())?;
//! let mut caches = run.cache.build(run.model())?;
//! generate(&run.runner, &run.tokenizer, &mut caches, "Why is the sky blue?", &GenerateOptions::default(), &mut |s| print!("{s}"))?;
//! # Ok(()) }
//! ```

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use veloq::artifact::Calibration;
use veloq::kernels::KernelChoice;

pub use crate::cuda_options::CudaOptions;

use crate::config::CacheConfig;
use crate::error::{Error, Result};
use crate::method::Method;
use crate::model::{LoadOptions, Model, Tokenizer, Weights};
use crate::runner::{Forward, Runner};

/// Where a model runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Device {
    /// The CPU (veloq's CPU kernels on rayon's pool).
    #[default]
    Cpu,
    /// CUDA device `n` (a build with the `cuda` feature).
    Cuda(usize),
}

impl FromStr for Device {
    type Err = Error;

    /// `cpu`, `cuda` (device 0) or `cuda:N`.
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => match s.strip_prefix("cuda:").map(str::parse) {
                Some(Ok(n)) => Ok(Device::Cuda(n)),
                Some(Err(_)) => Err(Error::Device(format!("device {s:?}: expected cuda:<ordinal>"))),
                None => Err(Error::Device(format!("device {s:?}: expected cpu, cuda or cuda:<ordinal>"))),
            },
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl Device {
    /// Opens the device as candle's, set up as veloq's CUDA paths expect: cudarc's per-buffer
    /// event tracking off (veloq orders its own second stream with events, and tracking would add
    /// driver calls to every launch) and the CUDA runtime configured with `cuda`.
    pub fn open(&self, cuda: &CudaOptions) -> Result<candle_core::Device> {
        match *self {
            Device::Cpu => Ok(candle_core::Device::Cpu),
            Device::Cuda(n) => open_cuda(n, cuda),
        }
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(ordinal: usize, options: &CudaOptions) -> Result<candle_core::Device> {
    let dev = candle_core::Device::new_cuda(ordinal)
        // candle's message carries a backtrace after its first line; the user needs the first line.
        .map_err(|e| {
            Error::Device(format!("opening CUDA device {ordinal}: {}", e.to_string().lines().next().unwrap_or("")))
        })?;
    if let candle_core::Device::Cuda(cuda) = &dev {
        // SAFETY: the model's and veloq's work is on this device's one stream but for the
        // caches' flushes, which veloq orders itself with events (a second stream and an event
        // per layer, `cache::cuda`); nothing else uses the device's buffers across streams.
        unsafe { cuda.disable_event_tracking() };
    }
    crate::cache::CudaRuntime::configure(&dev, options)?;
    Ok(dev)
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(ordinal: usize, _: &CudaOptions) -> Result<candle_core::Device> {
    Err(Error::Device(format!(
        "device cuda:{ordinal}: this veloq was built without CUDA (cargo build --release --features cuda)"
    )))
}

/// How [`load`] opens a model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunOptions {
    /// Where it runs.
    pub device: Device,
    /// Fused kernels or the portable path.
    pub kernels: KernelChoice,
    /// Longest context (prompt + generated) the caches accept; GPU caches reserve it up front.
    pub max_context: usize,
    /// What the GGUF's quantized weights are multiplied as.
    pub weights: Weights,
    /// The CUDA paths.
    pub cuda: CudaOptions,
}

impl Default for RunOptions {
    /// The CPU, fused kernels where they exist, 8,192 positions.
    fn default() -> Self {
        Self {
            device: Device::Cpu,
            kernels: KernelChoice::Auto,
            max_context: 8192,
            weights: Weights::Stored,
            cuda: CudaOptions::default(),
        }
    }
}

/// A model ready to run, its tokenizer and the configuration of its caches.
pub struct Loaded {
    /// The model, with CUDA graphs on CUDA.
    pub runner: Runner,
    /// The GGUF's own tokenizer.
    pub tokenizer: Tokenizer,
    /// The method's caches, to [`build`](CacheConfig::build) for one or many sequences.
    pub cache: CacheConfig,
}

impl Loaded {
    /// The model.
    pub fn model(&self) -> &Model {
        self.runner.model()
    }
}

/// Opens the GGUF model at `model` on `options.device` with its tokenizer, and configures the
/// caches of `method` (a VecInfer method loads the calibration at `calibration`, which must have
/// been made for this model and this method; any other method refuses one rather than ignore it).
pub fn load(model: &Path, method: &Method, calibration: Option<&Path>, options: &RunOptions) -> Result<Loaded> {
    let device = options.device.open(&options.cuda)?;
    let load = LoadOptions { max_context: options.max_context, weights: options.weights };
    let (m, tokenizer) = Model::open_with(model, &load, &device)?;
    let cal = match (method.needs_calibration(), calibration) {
        (true, Some(path)) => Some(Calibration::load_for(path, &m.info.identity)?),
        (true, None) => {
            return Err(Error::CalibrationMismatch(format!(
                "{method} needs a calibration file (veloq calibrate --model {} --method {method})",
                model.display()
            )))
        }
        (false, Some(path)) => {
            return Err(Error::CalibrationMismatch(format!("{method} takes no calibration (given {})", path.display())))
        }
        (false, None) => None,
    };
    let cache = CacheConfig { kernels: options.kernels, ..CacheConfig::new(*method, cal)? };
    Ok(Loaded { runner: Runner::new(m, &options.cuda), tokenizer, cache })
}

/// Where `veloq calibrate` writes, and `load` callers look for, the calibration of `method` for
/// the model file `model`: `<dir>/<model stem>.<method>.safetensors`.
pub fn calibration_path(dir: &Path, model: &Path, method: &Method) -> PathBuf {
    let stem = model.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    dir.join(format!("{stem}.{}.safetensors", method.file_stem()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_print_and_open() {
        for (s, d) in [("cpu", Device::Cpu), ("cuda", Device::Cuda(0)), ("cuda:3", Device::Cuda(3))] {
            assert_eq!(s.parse::<Device>().unwrap(), d);
        }
        assert_eq!(Device::Cuda(3).to_string().parse::<Device>().unwrap(), Device::Cuda(3));
        for bad in ["gpu", "cuda:x", ""] {
            assert!(matches!(bad.parse::<Device>(), Err(Error::Device(_))), "{bad}");
        }
        assert!(Device::Cpu.open(&CudaOptions::default()).unwrap().is_cpu());
        if !cfg!(feature = "cuda") {
            let e = Device::Cuda(0).open(&CudaOptions::default()).unwrap_err().to_string();
            assert!(e.contains("without CUDA"), "{e}");
        }
    }

    #[test]
    fn calibrations_are_named_by_model_and_method() {
        let p = calibration_path(Path::new("/c"), Path::new("/m/smollm2.q4_1.gguf"), &"vq-2/no-sink".parse().unwrap());
        assert_eq!(p, Path::new("/c/smollm2.q4_1.vq-2+no-sink.safetensors"));
    }
}
