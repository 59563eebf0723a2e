//! `veloq serve` on the real SmolLM2 model (scripts/fetch-data), as clients meet it: the official
//! `openai` Python client (installed by .ci/run), raw HTTP for bad input, idle and stalled
//! connections, clients that vanish mid-stream, and a load over a small KV budget that must queue,
//! finish everything and give the memory back.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// The servers share two cores: one test at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn cache_dir() -> std::path::PathBuf {
    std::env::var_os("VELOQ_CACHE")
        .map(Into::into)
        .unwrap_or_else(|| std::path::PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/veloq"))
}

fn veloq() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_veloq"));
    c.env("CANDLE_NUM_THREADS", "1");
    c
}

/// A `veloq serve` process on a free port, killed when dropped.
struct Server {
    child: Child,
    addr: SocketAddr,
    /// Its log lines so far.
    log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Server {
    fn start(args: &[&str]) -> Server {
        let model = cache_dir().join("smollm2-135m-instruct.q4_1.gguf");
        assert!(model.exists(), "{} missing: run scripts/fetch-data", model.display());
        Self::start_model(&model, args)
    }

    fn start_model(model: &std::path::Path, args: &[&str]) -> Server {
        let mut child = veloq()
            .args(["serve", "--port", "0", "--max-context", "2048", "--model"])
            .arg(model)
            .args(args)
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting veloq serve");
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let addr = loop {
            let line = lines.next().expect("veloq serve exited before listening").unwrap();
            eprintln!("[serve] {line}");
            if let Some(a) = line.strip_prefix("listening on http://") {
                break a.parse().unwrap();
            }
        };
        // Keep draining its log so it never blocks on a full pipe.
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let kept = log.clone();
        std::thread::spawn(move || {
            for l in lines {
                let l = l.unwrap_or_default();
                eprintln!("[serve] {l}");
                kept.lock().unwrap().push(l);
            }
        });
        Server { child, addr, log }
    }

    /// Whether a log line containing `needle` appears within a few seconds.
    fn logged(&self, needle: &str) -> bool {
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(5) {
            if self.log.lock().unwrap().iter().any(|l| l.contains(needle)) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    fn http(&self, method: &str, path: &str, body: &[u8]) -> (u16, String) {
        http(self.addr, method, path, body)
    }

    fn json(&self, method: &str, path: &str, body: &Value) -> (u16, Value) {
        json_request(self.addr, method, path, body)
    }

    /// Every sample of one `/metrics` response, by name and labels.
    fn metrics(&self) -> std::collections::HashMap<String, f64> {
        let (status, text) = self.http("GET", "/metrics", b"");
        assert_eq!(status, 200);
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| l.rsplit_once(' ').and_then(|(k, v)| Some((k.to_string(), v.trim().parse().ok()?))))
            .collect()
    }

    fn metric(&self, name: &str) -> f64 {
        *self.metrics().get(name).unwrap_or_else(|| panic!("no metric {name}"))
    }

    /// Waits until the server runs no sequence and holds no reservation: what its caches hold
    /// is only the finished sequences kept resident for their prefixes.
    fn drained(&self) {
        let t = Instant::now();
        loop {
            let m = self.metrics();
            if m["veloq_requests_running"] == 0.0
                && m["veloq_kv_reserved_bytes"] == 0.0
                && m["veloq_kv_borrowed_bytes"] == 0.0
                && m["veloq_kv_in_use_bytes"] == m["veloq_kv_prefix_bytes"]
            {
                break;
            }
            assert!(t.elapsed() < Duration::from_secs(60), "KV memory did not come back");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn healthy(&self) {
        assert_eq!(self.http("GET", "/health", b"").0, 200, "the server stopped answering");
    }
}

/// This process's open-file limit, its soft limit first raised to the hard one (the idle
/// connections below need a descriptor each).
fn open_files() -> usize {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit only read and write the struct passed by pointer, which lives on
    // this stack frame for both calls.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return 0;
        }
        let want = libc::rlimit { rlim_cur: lim.rlim_max, rlim_max: lim.rlim_max };
        if lim.rlim_cur < lim.rlim_max && libc::setrlimit(libc::RLIMIT_NOFILE, &want) == 0 {
            lim = want;
        }
    }
    lim.rlim_cur as usize
}

/// One request on a fresh connection: (status, body).
fn http(addr: SocketAddr, method: &str, path: &str, body: &[u8]) -> (u16, String) {
    let (status, _, body) = exchange(addr, method, path, &[], body);
    (status, body)
}

/// One request with extra header lines: (status, head in lower case, body).
fn exchange(addr: SocketAddr, method: &str, path: &str, headers: &[&str], body: &[u8]) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let extra: String = headers.iter().map(|h| format!("{h}\r\n")).collect();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{extra}Connection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    // A body over the limit may be refused before it is all sent.
    let _ = s.write_all(body);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    (status, head.to_lowercase(), body.to_string())
}

fn json_request(addr: SocketAddr, method: &str, path: &str, body: &Value) -> (u16, Value) {
    let (status, text) = http(addr, method, path, body.to_string().as_bytes());
    (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn completion(prompt: Value, max_tokens: usize) -> Value {
    json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
}

/// Runs a client's checks (`program script BASE_URL MODEL_ID`, which prints "all passed") against
/// a fresh fp16 server; `missing` is what stderr says when the client is not installed, `install`
/// how to install it.
fn client_checks(program: &str, script: &str, missing: &str, install: &str) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let server = Server::start(&["--method", "fp16"]);
    let (_, models) = server.json("GET", "/v1/models", &json!(null));
    let id = models["data"][0]["id"].as_str().unwrap().to_string();
    let out = Command::new(program)
        .args([script, &format!("http://{}/v1", server.addr), &id])
        .output()
        .unwrap_or_else(|e| panic!("{program} is needed for {script}: {e}"));
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("{stdout}");
    assert!(!stderr.contains(missing), "not installed: {install} (.ci/run does)");
    assert!(out.status.success(), "{script} failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("all passed"));
    server.drained();
}

/// The official Python client: streaming, n, structured output, tools, logprobs, errors.
#[test]
fn the_openai_client_streaming_and_not() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client.py");
    client_checks("python3", script, "No module named 'openai'", "python3 -m pip install openai==3.57.0");
}

/// LangChain's ChatOpenAI: invoke, stream, bind_tools, with_structured_output.
#[test]
fn the_langchain_client() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/langchain_client.py");
    let install = "python3 -m pip install langchain-openai==1.8.1";
    client_checks("python3", script, "No module named 'langchain_openai'", install);
}

/// lm-evaluation-harness's `local-completions`: a loglikelihood task over `echo` and `logprobs`,
/// its scores against the same GGUF run by transformers.
#[test]
fn lm_evaluation_harness_loglikelihood() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/lm_eval_client.py");
    let install = "python3 -m pip install lm_eval==0.4.13 transformers==5.24.0 torch==2.15.0 gguf accelerate";
    client_checks("python3", script, "No module named 'lm_eval'", install);
}

/// The official Node client and the Vercel AI SDK (generateText, streamText, generateObject, tools),
/// as `.ci/run` installs them (`npm ci` in tests/node, pinned by its lockfile).
#[test]
fn the_node_clients_and_the_ai_sdk() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/node/clients.mjs");
    let install = concat!("npm ci --prefix ", env!("CARGO_MANIFEST_DIR"), "/tests/node");
    client_checks("node", script, "ERR_MODULE_NOT_FOUND", install);
}

#[test]
fn bad_input_is_refused_and_the_server_stays_up() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let server = Server::start(&["--method", "fp16", "--max-body", "1MiB", "--header-timeout", "2"]);
    let chat = |extra: Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        b.to_string()
    };
    let cases: Vec<(&str, &str, String, u16, &str)> = vec![
        ("POST", "/v1/chat/completions", "{\"messages\": [".into(), 400, "malformed JSON"),
        ("POST", "/v1/chat/completions", "".into(), 400, "malformed JSON"),
        ("POST", "/v1/chat/completions", "[1, 2]".into(), 400, "invalid request"),
        ("POST", "/v1/chat/completions", chat(json!({"max_tokens": "ten"})), 400, "max_tokens"),
        ("POST", "/v1/chat/completions", chat(json!({"messages": "Hi"})), 400, "invalid type"),
        ("POST", "/v1/chat/completions", chat(json!({"top_p": 7})), 400, "top_p"),
        ("POST", "/v1/chat/completions", chat(json!({"temperature": -0.5})), 400, "temperature"),
        ("POST", "/v1/chat/completions", chat(json!({"temperature": "NaN"})), 400, "temperature"),
        (
            "POST",
            "/v1/chat/completions",
            "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], \"temperature\": NaN}".into(),
            400,
            "malformed JSON",
        ),
        ("POST", "/v1/chat/completions", chat(json!({"seed": -3})), 400, "seed"),
        ("POST", "/v1/chat/completions", chat(json!({"n": 0})), 400, "n must be between 1 and 128"),
        ("POST", "/v1/completions", json!({"prompt": "Hi", "n": 129}).to_string(), 400, "n must be between"),
        ("POST", "/v1/chat/completions", chat(json!({"model": "gpt-9"})), 404, "model_not_found"),
        ("POST", "/v1/chat/completions", chat(json!({"max_tokens": 100000})), 400, "context_length_exceeded"),
        ("POST", "/v1/chat/completions", chat(json!({"max_tokens": u64::MAX})), 400, "context_length_exceeded"),
        ("POST", "/v1/chat/completions", chat(json!({"messages": []})), 400, "at least one message"),
        ("POST", "/v1/chat/completions", chat(json!({"messages": [{"role": "robot", "content": "x"}]})), 400, "robot"),
        ("POST", "/v1/chat/completions", chat(json!({"max_token": 5})), 400, "unrecognized request argument"),
        (
            "POST",
            "/v1/chat/completions",
            chat(json!({"tools": [{"type": "web", "function": {"name": "f"}}]})),
            400,
            "tools",
        ),
        ("POST", "/v1/chat/completions", chat(json!({"tool_choice": "required"})), 400, "tools is empty"),
        (
            "POST",
            "/v1/chat/completions",
            chat(json!({"tools": [{"type": "function", "function": {"name": "f"}}],
                        "tool_choice": {"type": "function", "function": {"name": "g"}}})),
            400,
            "not in tools",
        ),
        ("POST", "/v1/chat/completions", chat(json!({"response_format": {"type": "yaml"}})), 400, "response_format"),
        (
            "POST",
            "/v1/chat/completions",
            chat(json!({"response_format": {"type": "json_object"}, "ignore_eos": true})),
            400,
            "not with ignore_eos",
        ),
        (
            "POST",
            "/v1/chat/completions",
            chat(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}})),
            400,
            "schema cannot be compiled",
        ),
        ("POST", "/v1/chat/completions", chat(json!({"logit_bias": {"99999999": 1}})), 400, "vocabulary"),
        ("POST", "/v1/chat/completions", chat(json!({"presence_penalty": 3})), 400, "presence_penalty"),
        ("POST", "/v1/chat/completions", chat(json!({"top_k": -4})), 400, "top_k"),
        ("POST", "/v1/completions", completion(json!([1, 99999999]), 4).to_string(), 400, "vocabulary"),
        ("POST", "/v1/completions", completion(json!(["a", "b"]), 4).to_string(), 400, "one prompt"),
        ("POST", "/v1/completions", completion(json!("word ".repeat(3000)), 4).to_string(), 400, "context"),
        ("GET", "/v1/chat/completions", String::new(), 405, "does not take GET"),
        ("GET", "/v2/anything", String::new(), 404, "no endpoint"),
        ("GET", "/v1/models/gpt-9", String::new(), 404, "model_not_found"),
        ("POST", "/v1/completions", "x".repeat(2 << 20), 413, "request_too_large"),
    ];
    for (method, path, body, status, says) in &cases {
        let (got, text) = server.http(method, path, body.as_bytes());
        assert_eq!(got, *status, "{method} {path} {}: {text}", &body[..body.len().min(80)]);
        assert!(text.contains(says), "{method} {path}: {text:?} should say {says:?}");
        if *status < 500 {
            let e: Value = serde_json::from_str(&text).unwrap();
            assert!(e["error"]["message"].is_string(), "OpenAI's error shape: {text}");
        }
        server.healthy();
    }
    assert!(server.logged("refused (400): this model's maximum context length"), "a refusal's log line");
    // What the engine itself refused: the three over the context, the two grammars it cannot run.
    assert_eq!(server.metric("veloq_requests_total{outcome=\"rejected\"}"), 5.0, "three contexts, two grammars");

    // Thousands of idle connections (2,000 where the open-file limit allows), and one that stalls half-way through its headers: the
    // server keeps answering, and closes the stalled one after the header timeout.
    let n = 2000.min(open_files().saturating_sub(256));
    assert!(n >= 500, "this process may open only {} files", open_files());
    let idle: Vec<TcpStream> = (0..n).map(|_| TcpStream::connect(server.addr).unwrap()).collect();
    let mut stalled = TcpStream::connect(server.addr).unwrap();
    stalled.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n").unwrap();
    let (status, reply) = server.json("POST", "/v1/completions", &completion(json!("The capital of France is"), 3));
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["usage"]["completion_tokens"], 3);
    // A bias of +100 on one token makes greedy decoding repeat it; penalties are accepted.
    let biased = |n: usize| {
        let mut body = completion(json!("The capital of France is"), n);
        body["logit_bias"] = json!({"330": 100});
        body["presence_penalty"] = json!(0.5);
        body["top_k"] = json!(20);
        let (status, reply) = server.json("POST", "/v1/completions", &body);
        assert_eq!(status, 200, "{reply}");
        reply["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let piece = biased(1);
    assert!(!piece.is_empty());
    assert_eq!(biased(3), piece.repeat(3));
    stalled.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let t = Instant::now();
    let mut buf = [0u8; 512];
    let n = stalled.read(&mut buf).unwrap_or(0);
    let answer = String::from_utf8_lossy(&buf[..n]);
    assert!(n == 0 || answer.starts_with("HTTP/1.1 408"), "a stalled request is closed, got {answer:?}");
    assert!(t.elapsed() < Duration::from_secs(15), "closed after the 2 s header timeout");
    drop(idle);
    server.healthy();

    // Clients that vanish mid-stream and while prefilling: their sequences are cancelled and the
    // KV memory returns.
    for max_tokens in [400, 1] {
        let mut s = TcpStream::connect(server.addr).unwrap();
        let prompt = if max_tokens == 1 { "word ".repeat(1500) } else { "Tell me a long story.".into() };
        let body = json!({"prompt": prompt, "max_tokens": max_tokens, "stream": true}).to_string();
        write!(s, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
        if max_tokens > 1 {
            let mut first = [0u8; 256];
            let n = s.read(&mut first).unwrap();
            assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"));
        } else {
            std::thread::sleep(Duration::from_millis(300));
        }
        drop(s);
    }
    server.drained();
    assert!(server.metric("veloq_requests_total{outcome=\"cancelled\"}") >= 1.0);
    assert!(server.logged("cancelled: the client left before the end"), "a vanished client's log line");
    // fp16 has no shared tables: once idle its caches hold only the finished sequences kept for
    // their prefixes.
    let (resident, prefixes) = (server.metric("veloq_kv_resident_bytes"), server.metric("veloq_kv_prefix_bytes"));
    assert_eq!(resident, prefixes, "fp16 holds nothing but resident prefixes once idle");
    let (status, _) = server.json("POST", "/v1/completions", &completion(json!("Hello"), 2));
    assert_eq!(status, 200);
}

#[test]
fn a_load_over_a_small_budget_queues_finishes_and_frees_everything() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("veloq-serve-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cal = dir.join("smollm2.vq-4.safetensors");
    let status = veloq()
        .args(["calibrate", "--tokens", "2048", "--window", "2048", "--out"])
        .arg(&cal)
        .arg("--model")
        .arg(cache_dir().join("smollm2-135m-instruct.q4_1.gguf"))
        .status()
        .unwrap();
    assert!(status.success(), "calibration failed");
    // First learn what one sequence of 256 positions costs, then give room for three and a half.
    let probe = Server::start(&["--method", "vq-4", "--calibration", cal.to_str().unwrap()]);
    let (_, models) = probe.json("GET", "/v1/models", &json!(null));
    let v = &models["data"][0]["veloq"];
    let shared = v["kv_shared_bytes"].as_u64().unwrap();
    let seq = v["kv_sequence_bytes"][0]["bytes"].as_u64().unwrap();
    assert_eq!(v["kv_sequence_bytes"][0]["positions"], 256);
    drop(probe);
    let budget = (shared + 3 * seq + seq / 2).to_string();
    let server = Server::start(&["--method", "vq-4", "--calibration", cal.to_str().unwrap(), "--kv-budget", &budget]);
    // Ten clients at once, each reaching exactly 256 positions (232 prompt tokens + 24).
    let prompts: Vec<Vec<u32>> =
        (0..10).map(|i| (0..232).map(|j| 1000 + ((i * 31 + j * 7) % 5000) as u32).collect()).collect();
    let addr = server.addr;
    let clients: Vec<_> = prompts
        .into_iter()
        .map(|p| std::thread::spawn(move || json_request(addr, "POST", "/v1/completions", &completion(json!(p), 24))))
        .collect();
    let (mut peak_reserved, mut saw_queue) = (0.0f64, false);
    while !clients.iter().all(|c| c.is_finished()) {
        let m = server.metrics();
        let (reserved, used, queued) =
            (m["veloq_kv_reserved_bytes"], m["veloq_kv_in_use_bytes"], m["veloq_requests_queued"]);
        let resident = m["veloq_kv_prefix_bytes"];
        assert!(
            used <= reserved + resident,
            "measured {used} B over the {reserved} B reserved and {resident} B resident"
        );
        assert!(reserved + resident <= (3 * seq + seq / 2) as f64, "{reserved} B reserved, {resident} B resident");
        peak_reserved = peak_reserved.max(reserved);
        saw_queue |= queued > 0.0;
        std::thread::sleep(Duration::from_millis(20));
    }
    for c in clients {
        let (status, reply) = c.join().unwrap();
        assert_eq!(status, 200, "{reply}");
        assert!(reply["usage"]["completion_tokens"].as_u64().unwrap() >= 1);
        assert_eq!(reply["usage"]["prompt_tokens"], 232);
    }
    assert!(saw_queue, "ten requests over a budget for three must queue");
    assert_eq!(server.metric("veloq_requests_running_peak"), 3.0, "three fit the budget");
    assert!(peak_reserved <= (3 * seq) as f64, "reserved {peak_reserved} B for three of {seq} B");
    assert_eq!(server.metric("veloq_requests_total{outcome=\"finished\"}"), 10.0);
    server.drained();
    assert_eq!(server.metric("veloq_requests_queued"), 0.0);
    // Ten different prompts share no prefix; what stays resident fits the budget.
    assert_eq!(server.metric("veloq_prefix_cache_hits_total"), 0.0);
    assert!(server.metric("veloq_prefix_resident_sequences") <= 3.0);
    // A chat's second turn starts from the first one's codes: only its new tokens are fed.
    let turn = |messages: &Value| {
        let body = json!({"messages": messages, "max_tokens": 24, "temperature": 0});
        let (status, reply) = server.json("POST", "/v1/chat/completions", &body);
        assert_eq!(status, 200, "{reply}");
        reply
    };
    let mut messages = json!([{"role": "user", "content": "Name three colours."}]);
    let first = turn(&messages);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let answer = first["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    assert!(!answer.trim().is_empty());
    let pushed = messages.as_array_mut().unwrap();
    pushed.push(json!({"role": "assistant", "content": answer}));
    pushed.push(json!({"role": "user", "content": "Now name three animals."}));
    let second = turn(&messages);
    let (prompt, cached) =
        (&second["usage"]["prompt_tokens"], &second["usage"]["prompt_tokens_details"]["cached_tokens"]);
    let (prompt, cached) = (prompt.as_u64().unwrap(), cached.as_u64().unwrap());
    assert!(cached >= first["usage"]["prompt_tokens"].as_u64().unwrap() && cached < prompt, "{second}");
    assert!(!second["choices"][0]["message"]["content"].as_str().unwrap().trim().is_empty(), "{second}");
    assert_eq!(server.metric("veloq_prefix_cache_hits_total"), 1.0);
    assert_eq!(server.metric("veloq_prompt_tokens_cached_total"), cached as f64);
    let label = "{model_name=\"smollm2-135m-instruct.q4_1\"}";
    assert_eq!(server.metric(&format!("vllm:prefix_cache_hits_total{label}")), cached as f64);
    server.drained();
    // Four choices of one prompt: the later three fork the first and read its codes, which the
    // caches hold once and the budget counts once (drained: resident bytes = bytes in use).
    let forks = server.metric("veloq_prefix_forks_total");
    let p: Vec<u32> = (0..232).map(|j| 2000 + (j * 13 % 5000) as u32).collect();
    let body = json!({"prompt": p, "max_tokens": 24, "temperature": 1.0, "seed": 5, "n": 4, "ignore_eos": true});
    let (status, reply) = server.json("POST", "/v1/completions", &body);
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["choices"].as_array().unwrap().len(), 4, "{reply}");
    assert_eq!(server.metric("veloq_prefix_forks_total") - forks, 3.0);
    server.drained();
    // All four stay resident inside a budget for three and a half whole sequences.
    assert!(server.metric("veloq_prefix_resident_sequences") >= 4.0);
    assert!(server.metric("veloq_kv_prefix_bytes") <= (3 * seq + seq / 2) as f64);
    let _ = std::fs::remove_dir_all(&dir);
}

/// API keys on /v1/* (401 naming the fix otherwise, /health open), CORS for the allowed origin
/// only (preflight answered, the header on answers and refusals), and the bound on waiting
/// requests (429 with Retry-After while one runs and one waits; both then finish).
#[test]
fn keys_cors_and_a_bounded_queue() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let app = "https://app.example";
    let server = Server::start(&[
        "--method",
        "fp16",
        "--api-key",
        "k1,k2",
        "--cors-origin",
        app,
        "--max-queued",
        "1",
        "--max-seqs",
        "1",
    ]);
    let addr = server.addr;
    let body = completion(json!("Once upon a time"), 2).to_string();
    let post = |headers: &[&str]| exchange(addr, "POST", "/v1/completions", headers, body.as_bytes());
    let (status, head, text) = post(&[]);
    assert_eq!(status, 401, "{text}");
    assert!(text.contains("invalid_api_key") && head.contains("www-authenticate: bearer"), "{head}{text}");
    assert_eq!(post(&["Authorization: Bearer nope"]).0, 401);
    assert_eq!(post(&["Authorization: Bearer k2"]).0, 200);
    assert_eq!(exchange(addr, "GET", "/v1/models", &[], b"").0, 401);
    assert_eq!(exchange(addr, "GET", "/health", &[], b"").0, 200);

    let origin = format!("Origin: {app}");
    let preflight = |origin: &str| {
        let h = [
            origin,
            "Access-Control-Request-Method: POST",
            "Access-Control-Request-Headers: authorization, content-type",
        ];
        exchange(addr, "OPTIONS", "/v1/chat/completions", &h, b"")
    };
    let (status, head, _) = preflight(&origin);
    assert_eq!(status, 204, "{head}");
    assert!(head.contains(&format!("access-control-allow-origin: {app}")), "{head}");
    assert!(head.contains("access-control-allow-headers: authorization, content-type"), "{head}");
    let (status, head, _) = preflight("Origin: https://elsewhere.example");
    assert_ne!(status, 204);
    assert!(!head.contains("access-control-allow-origin"), "{head}");
    let (status, head, _) = post(&[&origin, "Authorization: Bearer k1"]);
    assert!(status == 200 && head.contains("access-control-allow-origin"), "{head}");
    let (status, head, _) = post(&[&origin]);
    assert!(status == 401 && head.contains("access-control-allow-origin"), "a refusal the page can read: {head}");

    // One runs, one waits: a third is refused, the two finish.
    let long = {
        let mut b = completion(json!("Once upon a time"), 120);
        b["ignore_eos"] = json!(true);
        b.to_string()
    };
    let send = |wait_for: &'static str| {
        let long = long.clone();
        let h = std::thread::spawn(move || {
            exchange(addr, "POST", "/v1/completions", &["Authorization: Bearer k1"], long.as_bytes())
        });
        let t = Instant::now();
        while server.metric(wait_for) < 1.0 {
            assert!(t.elapsed() < Duration::from_secs(30), "no request reached {wait_for}");
            std::thread::sleep(Duration::from_millis(20));
        }
        h
    };
    let first = send("veloq_requests_running");
    let second = send("veloq_requests_queued");
    // The gateway's view under vLLM's names: one waiting, part of the budget held.
    let m = server.metrics();
    let gateway = |name: &str| {
        *m.iter()
            .find(|(k, _)| k.starts_with(&format!("vllm:{name}{{model_name=")))
            .unwrap_or_else(|| panic!("no {name}"))
            .1
    };
    assert_eq!((gateway("num_requests_running"), gateway("num_requests_waiting")), (1.0, 1.0));
    let used = gateway("kv_cache_usage_perc");
    assert!(used > 0.0 && used <= 1.0 && used == gateway("gpu_cache_usage_perc"), "{used}");
    let (status, head, text) = post(&["Authorization: Bearer k1"]);
    assert_eq!(status, 429, "{text}");
    assert!(text.contains("queue_full") && head.contains("retry-after: 1"), "{head}{text}");
    for h in [first, second] {
        let (status, _, text) = h.join().unwrap();
        assert_eq!(status, 200, "{text}");
    }
    assert_eq!(post(&["Authorization: Bearer k1"]).0, 200, "the bound frees as requests run");
    server.drained();
}

/// SIGTERM while a stream runs: the listener closes at once, the running stream finishes to its
/// `[DONE]`, and the process exits cleanly.
#[test]
fn shutdown_finishes_running_streams() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut server = Server::start(&["--method", "fp16"]);
    let addr = server.addr;
    let mut body = completion(json!("Once upon a time"), 60);
    body["ignore_eos"] = json!(true);
    body["stream"] = json!(true);
    let body = body.to_string();
    let stream = std::thread::spawn(move || exchange(addr, "POST", "/v1/completions", &[], body.as_bytes()));
    let t = Instant::now();
    while server.metric("veloq_requests_running") < 1.0 {
        assert!(t.elapsed() < Duration::from_secs(30), "the stream never ran");
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: kill only sends a signal to the child this test started and still owns.
    assert_eq!(unsafe { libc::kill(server.child.id() as i32, libc::SIGTERM) }, 0);
    let t = Instant::now();
    while TcpStream::connect(addr).is_ok() {
        assert!(t.elapsed() < Duration::from_secs(10), "still accepting after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (status, _, text) = stream.join().unwrap();
    assert_eq!(status, 200);
    assert!(text.contains("[DONE]") && !text.contains("\"error\""), "the stream ran to its end: {text}");
    assert!(text.contains("\"finish_reason\":\"length\""), "all 60 tokens came: {text}");
    let code = server.child.wait().unwrap();
    assert!(code.success(), "exit: {code:?}");
}

/// `n` choices feed their prompt once: the later choices start from a copy of the first one's
/// cache (the prompt fed once, then one token per further choice), and each samples its own text.
#[test]
fn n_choices_feed_their_prompt_once() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let server = Server::start(&["--method", "fp16"]);
    let content = "Apples, pears, plums, cherries, grapes, figs, dates, lemons, limes and melons: which of these fruits is the sweetest, and why?";
    let body = json!({"messages": [{"role": "user", "content": content}], "max_tokens": 12, "temperature": 1.0,
                      "seed": 3, "n": 3, "ignore_eos": true});
    let (fed, forks) = (server.metric("veloq_prompt_tokens_total"), server.metric("veloq_prefix_forks_total"));
    let (status, reply) = server.json("POST", "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{reply}");
    let prompt = reply["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt > 40, "{reply}");
    let texts: Vec<&str> =
        reply["choices"].as_array().unwrap().iter().map(|c| c["message"]["content"].as_str().unwrap()).collect();
    assert_eq!(texts.len(), 3, "{reply}");
    assert!(texts[0] != texts[1] && texts[1] != texts[2] && texts[0] != texts[2], "three samples: {texts:?}");
    assert_eq!(reply["usage"]["completion_tokens"], 36, "{reply}");
    assert_eq!(server.metric("veloq_prefix_forks_total") - forks, 2.0);
    assert_eq!(server.metric("veloq_prompt_tokens_total") - fed, (prompt + 2) as f64, "the prompt fed once");
    server.drained();
}

/// `--request-timeout`: a request that would run for a minute ends at its limit with what it has
/// generated (finish_reason "length"), and the server goes on serving.
#[test]
fn a_request_timeout_ends_long_requests() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let server = Server::start(&["--method", "fp16", "--request-timeout", "0.5"]);
    let mut body = completion(json!("Once upon a time"), 1500);
    body["ignore_eos"] = json!(true);
    let t = Instant::now();
    let (status, reply) = server.json("POST", "/v1/completions", &body);
    assert_eq!(status, 200, "{reply}");
    let generated = reply["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(reply["choices"][0]["finish_reason"] == "length" && generated < 1500, "{reply}");
    assert!(t.elapsed() < Duration::from_secs(20), "ended near its limit: {:?}", t.elapsed());
    assert!(server.logged("finish TimeLimit"), "the log says why it ended");
    let bad = veloq().args(["serve", "--request-timeout=-1"]).output().unwrap();
    assert!(String::from_utf8_lossy(&bad.stderr).contains("not a positive number of seconds"));
    server.drained();
}

/// Tools in the family's own format, on the tiny random GGUFs that carry Llama 3.1's and Mistral
/// Nemo's templates (`scripts/fixtures/chat_templates.py`): a tool loop sent as OpenAI clients send
/// it (arguments as JSON text, `content: null`) becomes the prompt llama-server --jinja builds
/// (its length; the ids themselves are checked in veloq-candle's `chat_templates`), and a forced
/// call comes back parsed from the family's form (`{"name", "parameters"}`, `[{"name",
/// "arguments"}]`) with an id Mistral's template takes back.
#[test]
fn tools_in_the_families_own_formats() {
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../veloq-candle/tests/fixtures");
    for name in ["llama3-chat-tiny", "mistral-chat-tiny"] {
        let s = Server::start_model(&fixtures.join(format!("{name}.gguf")), &["--method", "fp16"]);
        let cases: Vec<Value> =
            serde_json::from_slice(&std::fs::read(fixtures.join(format!("{name}.chat.json"))).unwrap()).unwrap();
        let case = cases.iter().find(|c| c["name"] == "a tool loop").unwrap();
        let mut messages = case["request"]["messages"].clone();
        messages[1]["content"] = Value::Null;
        let arguments = &mut messages[1]["tool_calls"][0]["function"]["arguments"];
        *arguments = json!(arguments.to_string());
        let body = json!({"messages": messages, "tools": case["request"]["tools"], "max_tokens": 1,
                          "chat_template_kwargs": {"date_string": "26 Jul 2024"}});
        let (status, r) = s.json("POST", "/v1/chat/completions", &body);
        assert_eq!(status, 200, "{name}: {r}");
        assert_eq!(r["usage"]["prompt_tokens"], case["ids"].as_array().unwrap().len(), "{name}: {r}");

        let unit = json!([{"type": "function", "function": {"name": "set_unit", "parameters": {"type": "object",
            "properties": {"unit": {"type": "string", "enum": ["C", "F"]}}, "required": ["unit"],
            "additionalProperties": false}}}]);
        let body = json!({"messages": [{"role": "user", "content": "Use Celsius."}], "tools": unit,
                          "tool_choice": "required", "max_tokens": 120, "temperature": 0});
        let (status, r) = s.json("POST", "/v1/chat/completions", &body);
        assert_eq!(status, 200, "{name}: {r}");
        let choice = &r["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls", "{name}: {r}");
        let call = &choice["message"]["tool_calls"][0];
        assert_eq!(call["function"]["name"], "set_unit", "{name}: {r}");
        let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
        assert!(args["unit"] == "C" || args["unit"] == "F", "{name}: {args}");
        let id = call["id"].as_str().unwrap();
        assert!(id.len() == 9 && id.chars().all(|c| c.is_ascii_alphanumeric()), "{name}: {id}");
        // The call goes back into the conversation with its result, and the template takes it.
        let body = json!({"messages": [{"role": "user", "content": "Use Celsius."}, choice["message"],
                          {"role": "tool", "tool_call_id": id, "content": "done"}], "tools": unit, "max_tokens": 1});
        let (status, r) = s.json("POST", "/v1/chat/completions", &body);
        assert_eq!(status, 200, "{name}: {r}");
    }
}

/// A `--calibration` given for a method that takes none is refused by name, not dropped.
#[test]
fn a_calibration_for_a_method_that_takes_none_is_refused() {
    let model = cache_dir().join("smollm2-135m-instruct.q4_1.gguf");
    let out = veloq()
        .args([
            "generate",
            "--method",
            "kivi-4",
            "--max-tokens",
            "1",
            "--prompt",
            "hi",
            "--calibration",
            "any.safetensors",
            "--model",
        ])
        .arg(&model)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("kivi-4 takes no calibration"), "{err}");
}
