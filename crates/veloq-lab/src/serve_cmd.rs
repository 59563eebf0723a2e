//! `veloq-lab serve`: the product's `veloq serve`, or the same server over a random-weight model
//! of a real geometry (`--model synthetic:llama8b`, words `w0`, `w1`… as tokens) for load tests
//! at a size no real file here has.

use std::sync::Arc;

use anyhow::{Context, Result};

use veloq_candle::config::CacheConfig;
use veloq_candle::model::{word_tokenizer, Weights};
use veloq_candle::{Method, Runner};
use veloq_cli::serve;
pub use veloq_cli::serve::Args;
use veloq_lab::synthetic::{geometry, synthetic_calibration, Rng};
use veloq_server::{Server, Serving};

/// Serves `a` (a synthetic model when its `--model` says `synthetic:NAME`).
pub fn run(a: Args) -> Result<()> {
    let model = a.run.files.model();
    let Some(name) = model.to_str().and_then(|p| p.strip_prefix("synthetic:")) else { return serve::run(a) };
    if a.run.weights != Weights::Stored {
        anyhow::bail!(
            "--weights {}: a synthetic model's weights are random f16 already (it has no GGUF blocks)",
            a.run.weights
        );
    }
    let (g, label) = geometry(name)?;
    let cuda = a.run.cuda.options(&a.run.files.cache_dir);
    let device = a.run.device.open(&cuda)?;
    let m = g.model(label, a.run.max_context, &device, 7)?;
    let cal = match a.run.method {
        Method::VecInfer(vq) => Some(synthetic_calibration(&m, &vq, &mut Rng(0x9E37_79B9_7F4A_7C15))?),
        _ => None,
    };
    let cache = CacheConfig { kernels: a.run.kernels, ..CacheConfig::new(a.run.method, cal)? };
    let serving = Serving {
        runner: Arc::new(Runner::new(m, &cuda)),
        tokenizer: Arc::new(word_tokenizer(g.vocab)),
        cache,
        engine: a.engine(),
        name: label.to_string(),
    };
    let options = a.options();
    let server = Server::start(serving, &options).context("starting the server")?;
    eprintln!("veloq-lab serve: {label} ({}) on {}", a.run.method, a.run.device);
    eprintln!("listening on http://{}", server.addr());
    Ok(server.wait()?)
}
