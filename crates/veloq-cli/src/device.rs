//! `--device`: where the model runs.

use anyhow::{bail, Context, Result};
use candle_core::Device;

/// `cpu`, `cuda` or `cuda:N`. CUDA needs a build with `--features cuda` and a GPU.
pub fn parse(s: &str) -> Result<Device> {
    let ordinal = match s {
        "cpu" => return Ok(Device::Cpu),
        "cuda" => 0,
        _ => match s.strip_prefix("cuda:") {
            Some(n) => n.parse().with_context(|| format!("device {s:?}: expected cuda:<ordinal>"))?,
            None => bail!("device {s:?}: expected cpu, cuda or cuda:<ordinal>"),
        },
    };
    if !cfg!(feature = "cuda") {
        bail!("device {s:?}: this veloq was built without CUDA (cargo build --release --features cuda)");
    }
    let dev = Device::new_cuda(ordinal).with_context(|| format!("opening CUDA device {ordinal}"))?;
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = &dev {
        // SAFETY: the runner puts all work (candle's and veloq's kernels) on this device's one
        // stream, except the caches' flushes, which veloq orders itself with events (a second
        // stream and an event per layer, `veloq_candle::cache::cuda`); cudarc's per-buffer event
        // tracking would only add driver calls to every launch.
        unsafe { cuda.disable_event_tracking() };
    }
    Ok(dev)
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_and_refuses() {
        assert!(super::parse("cpu").unwrap().is_cpu());
        assert!(super::parse("gpu").is_err());
        assert!(super::parse("cuda:x").is_err());
        if !cfg!(feature = "cuda") {
            let e = super::parse("cuda").unwrap_err().to_string();
            assert!(e.contains("without CUDA"), "{e}");
        }
    }
}
