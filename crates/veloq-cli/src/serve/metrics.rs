//! `/metrics` in Prometheus' text format: the engine's queue, tokens, KV memory and speeds.

use std::fmt::Write;

use veloq_candle::engine::{EngineInfo, Stats};

/// The exposition text of one snapshot.
pub fn render(info: &EngineInfo, s: &Stats) -> String {
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, samples: &[(&str, f64)]| {
        let _ = writeln!(out, "# HELP veloq_{name} {help}\n# TYPE veloq_{name} {kind}");
        for (labels, v) in samples {
            let _ = writeln!(out, "veloq_{name}{labels} {v}");
        }
    };
    let method = format!("{{method=\"{}\"}}", info.method);
    metric("requests_running", "gauge", "Sequences admitted and generating.", &[("", s.running as f64)]);
    metric("requests_queued", "gauge", "Requests waiting for KV memory or a slot.", &[("", s.queued as f64)]);
    metric("requests_running_peak", "gauge", "Most sequences that ran at once.", &[("", s.peak_running as f64)]);
    metric(
        "requests_total",
        "counter",
        "Requests by how they ended.",
        &[
            ("{outcome=\"finished\"}", s.finished as f64),
            ("{outcome=\"cancelled\"}", s.cancelled as f64),
            ("{outcome=\"rejected\"}", s.rejected as f64),
            ("{outcome=\"failed\"}", s.failed as f64),
        ],
    );
    metric("prompt_tokens_total", "counter", "Prompt tokens fed to the model.", &[("", s.prompt_tokens as f64)]);
    metric("generation_tokens_total", "counter", "Tokens generated.", &[("", s.generated_tokens as f64)]);
    metric("steps_total", "counter", "Forward passes (continuous-batching steps).", &[("", s.steps as f64)]);
    metric(
        "kv_budget_bytes",
        "gauge",
        "KV cache budget (shared tables and sequences).",
        &[("", info.kv_budget as f64)],
    );
    metric(
        "kv_shared_bytes",
        "gauge",
        "Tables every sequence shares (codebooks, scales).",
        &[("", info.shared_bytes as f64)],
    );
    metric(
        "kv_reserved_bytes",
        "gauge",
        "Worst-case KV bytes reserved by admitted sequences.",
        &[("", s.kv_reserved_bytes as f64)],
    );
    metric(
        "kv_in_use_bytes",
        "gauge",
        "KV bytes the sequences' storage holds now (measured from the caches on the CPU; the running slots' reservations on GPUs).",
        &[("", s.kv_sequence_bytes as f64)],
    );
    metric(
        "kv_resident_bytes",
        "gauge",
        "KV bytes the caches hold now, shared tables included.",
        &[("", s.kv_resident_bytes as f64)],
    );
    metric(
        "kv_bytes_per_position",
        "gauge",
        "Storage bytes per cached position of the method (all layers, keys and values).",
        &[(&method, info.bytes_per_position)],
    );
    metric("sequence_slots", "gauge", "Sequences the caches can hold at once.", &[("", info.slots as f64)]);
    metric("max_context_tokens", "gauge", "Positions a sequence may reach.", &[("", info.max_context as f64)]);
    metric(
        "prefill_tokens_per_second",
        "gauge",
        "Prompt tokens per second over the last 10 s.",
        &[("", s.prefill_tok_s)],
    );
    metric(
        "decode_tokens_per_second",
        "gauge",
        "Generated tokens per second over the last 10 s (all sequences).",
        &[("", s.decode_tok_s)],
    );
    out
}
