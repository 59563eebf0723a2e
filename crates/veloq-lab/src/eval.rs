//! Quality on real text: perplexity, KL divergence from the fp16 cache's next-token distribution,
//! and top-1 agreement with it, for several cache methods over the same token windows.
//!
//! The text is cut into windows of `ctx` tokens (fresh caches per window) and, like llama.cpp's
//! perplexity tool, only the second half of each window is scored, so every scored token has at
//! least `ctx/2` tokens of context. Tokens are fed `step` at a time (teacher forcing), so each
//! query attends over what the cache really holds: codes for old positions, the f16 window for
//! recent ones, exactly as during decode. Feeding a whole window at once would let a compressed
//! cache attend over its own exact inputs and flatter it.
//!
//! A model whose file asks for a BOS (`tokenizer.ggml.add_bos_token`, Gemma) gets it as each
//! window's first token in place of the text's, as llama.cpp's perplexity tool does, so the two
//! score the same windows.

use candle_core::{DType, D};

use veloq_candle::error::{Error, Result};
use veloq_candle::model::{Logits, Model};

use crate::source::CacheSource;

#[derive(Clone, Copy, Debug)]
/// How [`evaluate`] cuts and feeds the text.
pub struct EvalConfig {
    /// Tokens per window.
    pub ctx: usize,
    /// Windows evaluated (consecutive, from the start of the text).
    pub windows: usize,
    /// Tokens per forward call.
    pub step: usize,
}

/// One method's scores over all windows.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct MethodScore {
    /// The method's name.
    pub label: String,
    /// Stored bits per element of a full window, every byte of metadata counted.
    pub code_bits: f64,
    /// Bits per element of the coded stream (codes + per-token/group scales, shared tables
    /// excluded): what the rate converges to at long context.
    pub stream_bits: f64,
    /// Bytes the caches held at the end of a window (measured from the caches).
    pub resident_bytes: usize,
    /// Tokens scored.
    pub scored: usize,
    /// Negative log-likelihood summed over them.
    pub nll_sum: f64,
    /// KL divergence from fp16's distribution summed over them.
    pub kl_sum: f64,
    /// Tokens whose argmax equals fp16's.
    pub top1_same: usize,
}

impl MethodScore {
    /// Perplexity.
    pub fn ppl(&self) -> f64 {
        (self.nll_sum / self.scored as f64).exp()
    }
    /// Mean KL divergence from fp16.
    pub fn kl(&self) -> f64 {
        self.kl_sum / self.scored as f64
    }
    /// Share of tokens with fp16's argmax.
    pub fn top1(&self) -> f64 {
        self.top1_same as f64 / self.scored as f64
    }
}

/// Scores `methods` (the first must be the fp16 reference) on `tokens`; refuses a calibrated
/// method whose calibration text overlaps the evaluated tokens. `progress(tokens)` after
/// each forward call, counting tokens over all methods and windows.
pub fn evaluate(
    model: &Model,
    tokens: &[u32],
    methods: &[(String, &dyn CacheSource)],
    cfg: EvalConfig,
    progress: &mut dyn FnMut(usize),
) -> Result<Vec<MethodScore>> {
    if cfg.ctx < 2 * cfg.step || cfg.step == 0 || cfg.windows == 0 {
        return Err(Error::Config(format!(
            "eval: ctx {} must hold two steps of {} and windows ≥ 1",
            cfg.ctx, cfg.step
        )));
    }
    if tokens.len() < cfg.ctx * cfg.windows {
        return Err(Error::Config(format!(
            "eval: {} windows of {} need {} tokens, the text has {}",
            cfg.windows,
            cfg.ctx,
            cfg.ctx * cfg.windows,
            tokens.len()
        )));
    }
    if !methods.first().is_some_and(|(_, c)| c.is_reference()) {
        return Err(Error::Config("eval: the first method must be fp16 (the reference)".into()));
    }
    let span = &tokens[..cfg.ctx * cfg.windows];
    for (label, c) in methods {
        if let Some(text) = c.calibration_text() {
            if let Some(at) = text.first_overlap(span) {
                return Err(Error::CalibrationOverlap { method: label.clone(), at });
            }
        }
    }
    let mut scores: Vec<MethodScore> = methods
        .iter()
        .map(|(label, c)| {
            Ok(MethodScore {
                label: label.clone(),
                code_bits: c.code_bits(model, cfg.ctx)?,
                stream_bits: c.stream_bits(model)?,
                ..Default::default()
            })
        })
        .collect::<Result<_>>()?;
    let mut done = 0;
    for w in 0..cfg.windows {
        let mut window = tokens[w * cfg.ctx..(w + 1) * cfg.ctx].to_vec();
        if let Some(bos) = model.info.bos {
            window[0] = bos;
        }
        let mut reference: Vec<Vec<f32>> = Vec::new();
        for (m, (_, config)) in methods.iter().enumerate() {
            let mut caches = config.build(model, 1, None)?;
            let first = cfg.ctx / 2;
            let mut scored = 0;
            for start in (0..cfg.ctx).step_by(cfg.step) {
                let end = (start + cfg.step).min(cfg.ctx);
                // Logits are needed only where position p predicts a scored token p + 1.
                let want = end > first;
                let which = if want { Logits::All } else { Logits::Last };
                let logits = model.forward(&window[start..end], &mut caches, which)?;
                done += end - start;
                progress(done);
                if !want {
                    continue;
                }
                let lp = candle_nn::ops::log_softmax(&logits.to_dtype(DType::F32)?, D::Minus1)?;
                let from = first.max(start);
                let to = (end).min(cfg.ctx - 1);
                if from >= to {
                    continue;
                }
                let rows: Vec<Vec<f32>> = lp.narrow(0, from - start, to - from)?.to_vec2::<f32>()?;
                for (i, row) in rows.into_iter().enumerate() {
                    let target = window[from + i + 1] as usize;
                    let s = &mut scores[m];
                    s.nll_sum -= row[target] as f64;
                    if m == 0 {
                        reference.push(row);
                    } else {
                        let r = &reference[scored];
                        s.kl_sum += kl(r, &row);
                        s.top1_same += (argmax(r) == argmax(&row)) as usize;
                    }
                    s.scored += 1;
                    scored += 1;
                }
            }
            if m == 0 {
                scores[0].top1_same += scored;
            }
            scores[m].resident_bytes = scores[m].resident_bytes.max(caches.resident_bytes());
        }
    }
    // Bits again once scored: a candidate's can depend on what it coded (outlier rows kept).
    for (s, (_, c)) in scores.iter_mut().zip(methods) {
        s.code_bits = c.code_bits(model, cfg.ctx)?;
        s.stream_bits = c.stream_bits(model)?;
    }
    Ok(scores)
}

/// KL(p ‖ q) from log-probabilities, in nats.
fn kl(lp: &[f32], lq: &[f32]) -> f64 {
    lp.iter().zip(lq).map(|(&a, &b)| (a.exp() as f64) * (a as f64 - b as f64)).sum::<f64>().max(0.0)
}

fn argmax(x: &[f32]) -> usize {
    x.iter().enumerate().fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| if v > bv { (i, v) } else { (bi, bv) }).0
}

/// Total positions run through the model for `methods` methods.
pub fn total_tokens(cfg: &EvalConfig, methods: usize) -> usize {
    cfg.ctx * cfg.windows * methods
}
