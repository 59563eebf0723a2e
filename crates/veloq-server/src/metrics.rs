//! `/metrics` in Prometheus' text format: the engine's queue, tokens, KV memory and speeds, and
//! the same queue and KV use under vLLM's names, which inference gateways (the Gateway API
//! Inference Extension's endpoint picker, llm-d) read to route and scale.

use std::fmt::Write;

use veloq_candle::engine::{EngineInfo, Stats};

/// One metric: name, type, help and its samples as (labels, value).
type Metric<'a> = (&'a str, &'a str, &'a str, Vec<(String, f64)>);

/// The exposition text of one snapshot of the engine serving `model`.
pub fn render(info: &EngineInfo, s: &Stats, model: &str) -> String {
    let method = format!("{{method=\"{}\"}}", info.method);
    let one = |v: f64| vec![(String::new(), v)];
    let metrics: Vec<Metric> = vec![
        ("requests_running", "gauge", "Sequences admitted and generating.", one(s.running as f64)),
        ("requests_queued", "gauge", "Requests waiting for KV memory or a slot.", one(s.queued as f64)),
        ("requests_running_peak", "gauge", "Most sequences that ran at once.", one(s.peak_running as f64)),
        (
            "requests_total",
            "counter",
            "Requests by how they ended.",
            [("finished", s.finished), ("cancelled", s.cancelled), ("rejected", s.rejected), ("failed", s.failed)]
                .iter()
                .map(|(o, n)| (format!("{{outcome=\"{o}\"}}"), *n as f64))
                .collect(),
        ),
        ("prompt_tokens_total", "counter", "Prompt tokens fed to the model.", one(s.prompt_tokens as f64)),
        (
            "preemptions_total",
            "counter",
            "Running sequences preempted to make room (--reserve grow); each resumed later.",
            one(s.preempted as f64),
        ),
        (
            "prompt_tokens_cached_total",
            "counter",
            "Prompt tokens found resident from an earlier or running request (not fed again).",
            one(s.cached_prompt_tokens as f64),
        ),
        (
            "prefix_cache_hits_total",
            "counter",
            "Requests that started from a resident prefix.",
            one(s.prefix_hits as f64),
        ),
        (
            "prefix_forks_total",
            "counter",
            "Requests that started from a copy of a running or resident sequence's prefix (n choices, a shared system prompt).",
            one(s.forks as f64),
        ),
        (
            "prefix_resident_sequences",
            "gauge",
            "Finished sequences kept resident for their prefixes.",
            one(s.resident_prefixes as f64),
        ),
        (
            "kv_prefix_bytes",
            "gauge",
            "KV bytes resident finished sequences hold (given up when a request needs the room).",
            one(s.kv_prefix_bytes as f64),
        ),
        ("generation_tokens_total", "counter", "Tokens generated.", one(s.generated_tokens as f64)),
        ("steps_total", "counter", "Forward passes (continuous-batching steps).", one(s.steps as f64)),
        ("kv_budget_bytes", "gauge", "KV cache budget (shared tables and sequences).", one(info.kv_budget as f64)),
        ("kv_shared_bytes", "gauge", "Tables every sequence shares (codebooks, scales).", one(info.shared_bytes as f64)),
        (
            "kv_reserved_bytes",
            "gauge",
            "Worst-case KV bytes reserved by admitted sequences.",
            one(s.kv_reserved_bytes as f64),
        ),
        (
            "kv_in_use_bytes",
            "gauge",
            "KV bytes the sequences' storage holds now, resident prefixes included (measured from the caches on the CPU; the slots' reservations on GPUs).",
            one(s.kv_sequence_bytes as f64),
        ),
        (
            "kv_resident_bytes",
            "gauge",
            "KV bytes the caches hold now, shared tables included.",
            one(s.kv_resident_bytes as f64),
        ),
        (
            "kv_borrowed_bytes",
            "gauge",
            "KV bytes running forks read from their source's storage instead of a copy (counted once).",
            one(s.kv_borrowed_bytes as f64),
        ),
        (
            "kv_bytes_per_position",
            "gauge",
            "Storage bytes per cached position of the method (all layers, keys and values).",
            vec![(method, info.bytes_per_position)],
        ),
        ("sequence_slots", "gauge", "Sequences the caches can hold at once.", one(info.slots as f64)),
        ("max_context_tokens", "gauge", "Positions a sequence may reach.", one(info.max_context as f64)),
        ("prefill_tokens_per_second", "gauge", "Prompt tokens per second over the last 10 s.", one(s.prefill_tok_s)),
        (
            "decode_tokens_per_second",
            "gauge",
            "Generated tokens per second over the last 10 s (all sequences).",
            one(s.decode_tok_s),
        ),
    ];
    let mut out = String::new();
    for (name, kind, help, samples) in metrics {
        let _ = writeln!(out, "# HELP veloq_{name} {help}\n# TYPE veloq_{name} {kind}");
        for (labels, v) in samples {
            let _ = writeln!(out, "veloq_{name}{labels} {v}");
        }
    }
    // What admission holds of the budget: shared tables and admitted sequences' reservations.
    let used = (info.shared_bytes + s.kv_reserved_bytes) as f64 / info.kv_budget.max(1) as f64;
    let label = format!("{{model_name=\"{}\"}}", model.replace('\\', "\\\\").replace('"', "\\\""));
    for (name, help, v) in [
        ("num_requests_running", "Requests running (veloq_requests_running).", s.running as f64),
        ("num_requests_waiting", "Requests waiting for admission (veloq_requests_queued).", s.queued as f64),
        ("kv_cache_usage_perc", "Fraction of the KV budget held (shared tables and reservations), 0 to 1.", used),
        ("gpu_cache_usage_perc", "The same fraction under vLLM's older name.", used),
    ] {
        let _ = writeln!(out, "# HELP vllm:{name} {help}\n# TYPE vllm:{name} gauge\nvllm:{name}{label} {v}");
    }
    // vLLM counts prefix caching in prompt tokens: queried (every admitted prompt) and hit.
    let queried = (s.prompt_tokens + s.cached_prompt_tokens) as f64;
    for (name, help, v) in [
        ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queried),
        ("prefix_cache_hits", "Prompt tokens found there.", s.cached_prompt_tokens as f64),
    ] {
        let _ = writeln!(out, "# HELP vllm:{name} {help}\n# TYPE vllm:{name} counter\nvllm:{name}_total{label} {v}");
    }
    out
}
