//! The HTTP endpoints: OpenAI's chat and text completions (whole or streamed as server-sent
//! events), the model list, health and Prometheus metrics. Every failure is an OpenAI-shaped error
//! with a 4xx or 5xx status; nothing a client sends can take the server down.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{header, Method, StatusCode, Uri};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use veloq_candle::engine::{Engine, Event, Rejected, Sink, Summary};
use veloq_candle::generate::{transcript_ids, with_bos, Finish};
use veloq_candle::model::{decode, encode, Tokenizer};
use veloq_candle::Forward;

use crate::api::{
    check_fields, finish_reason, from_body, logprob_json, prompt_logprob_json, ApiError, ChatRequest, Choice,
    CompletionRequest, Kind, Prompt, Reply, Sampling, Usage, CHAT_FIELDS, COMPLETION_FIELDS,
};
use crate::guard::{guard, Active, Gate, Guards, Waiting};
use crate::metrics;
use crate::tools::{Call, ToolFormat, Tools};

/// What every handler shares.
pub(crate) struct App {
    pub engine: Engine,
    pub model: Arc<dyn Forward>,
    pub tok: Arc<Tokenizer>,
    /// The id clients name the model by.
    pub name: String,
    /// When the server started (Unix seconds), the models' `created`.
    pub created: u64,
    /// Chat completions without `max_tokens` get at most this (default: the rest of the context).
    pub default_max_tokens: Option<usize>,
    /// Every request's time limit.
    pub request_timeout: Option<Duration>,
    pub next_id: AtomicU64,
    /// Print a line per finished request on stderr.
    pub log: bool,
    /// Keys, CORS, the queue's bound.
    pub guards: Guards,
    /// Requests submitted and not yet admitted.
    pub waiting: Arc<AtomicUsize>,
    /// Requests in flight (handlers and streams).
    pub active: Arc<AtomicUsize>,
    /// Set at shutdown: new requests get a 503 while the running ones finish.
    pub draining: Arc<AtomicBool>,
}

pub(crate) fn router(app: Arc<App>, max_body: usize) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .method_not_allowed_fallback(wrong_method)
        .layer(axum::extract::DefaultBodyLimit::max(max_body))
        .layer(axum::middleware::from_fn_with_state(
            Arc::new(Gate { guards: app.guards.clone(), draining: app.draining.clone() }),
            guard,
        ))
        .with_state(app)
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut r = (status, Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut().insert(header::RETRY_AFTER, s.into());
        }
        r
    }
}

async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::invalid(None, format!("no endpoint {method} {uri}")).status(404).with_code("not_found")
}

async fn wrong_method(method: Method, uri: Uri) -> ApiError {
    ApiError::invalid(None, format!("{uri} does not take {method}")).status(405).with_code("method_not_allowed")
}

/// The body, or a 413 when over the limit.
fn read(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|r| {
        let status = r.status().as_u16();
        let e = ApiError::invalid(None, format!("could not read the request body: {}", r.body_text())).status(status);
        if status == 413 {
            e.with_code("request_too_large")
        } else {
            e
        }
    })
}

impl App {
    fn check_model(&self, s: &Sampling) -> Result<(), ApiError> {
        match &s.model {
            Some(m) if *m != self.name => Err(ApiError::invalid(
                Some("model"),
                format!("the model {m:?} does not exist; this server serves {:?}", self.name),
            )
            .status(404)
            .with_code("model_not_found")),
            _ => Ok(()),
        }
    }

    fn reply(&self, kind: Kind) -> Reply {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let prefix = if kind == Kind::Chat { "chatcmpl" } else { "cmpl" };
        Reply { kind, id: format!("{prefix}-{:x}-{n}", self.created), created: unix_now(), model: self.name.clone() }
    }
}

pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

async fn chat(State(app): State<Arc<App>>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let body = read(body)?;
    let (req, sampling): (ChatRequest, Sampling) = (from_body(&body)?, from_body(&body)?);
    check_fields(&body, CHAT_FIELDS)?;
    app.check_model(&sampling)?;
    let template = app.model.model().chat_template(&app.tok);
    let tools = req.tools(ToolFormat::of(&template))?;
    let transcript = req.transcript(tools.as_ref(), &template)?;
    let (model, tok) = (app.model.clone(), app.tok.clone());
    let ids = tokenize(move || transcript_ids(model.model(), &tok, &transcript).map_err(|e| e.to_string())).await?;
    let room = app.engine.info().max_context.saturating_sub(ids.len());
    let default = app.default_max_tokens.map_or(room, |d| d.min(room));
    let logprobs = req.logprobs(&sampling)?;
    let mut request = sampling.request(ids, req.max_completion_tokens, default, app.engine.info().vocab, logprobs)?;
    request.grammar = req.grammar(tools.as_ref())?;
    request.time_limit = app.request_timeout;
    let calls = tools.map(|tools| CallReader { tools, parallel: req.parallel_tool_calls.unwrap_or(true) });
    run(app.clone(), app.reply(Kind::Chat), sampling.choices(request)?, &sampling, calls, None).await
}

async fn completions(State(app): State<Arc<App>>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let body = read(body)?;
    let (req, sampling): (CompletionRequest, Sampling) = (from_body(&body)?, from_body(&body)?);
    check_fields(&body, COMPLETION_FIELDS)?;
    let logprobs = sampling.completion_logprobs()?;
    app.check_model(&sampling)?;
    let echo = req.echo == Some(true);
    if echo && sampling.stream {
        return Err(ApiError::invalid(Some("echo"), "echo is not supported with stream (ask for the whole response)"));
    }
    for (field, used) in [("suffix", req.suffix.is_some()), ("best_of", req.best_of.is_some_and(|b| b != 1))] {
        if used {
            return Err(ApiError::invalid(Some(field), format!("{field} is not supported (only its off value)")));
        }
    }
    // lm-evaluation-harness sends its tokenized prompt as a batch of one.
    let prompt = match req.prompt.clone() {
        Prompt::TokenLists(mut v) if v.len() == 1 => Prompt::Tokens(v.pop().unwrap_or_default()),
        Prompt::TokenLists(v) => {
            return Err(ApiError::invalid(Some("prompt"), format!("one prompt per request, got {}", v.len())))
        }
        p => p,
    };
    let ids = match prompt.clone() {
        Prompt::Text(t) => text_ids(&app, t).await?,
        Prompt::Texts(v) if v.len() == 1 => text_ids(&app, v.into_iter().next().unwrap_or_default()).await?,
        Prompt::Texts(v) => {
            return Err(ApiError::invalid(Some("prompt"), format!("one prompt per request, got {}", v.len())))
        }
        Prompt::Tokens(ids) => {
            let vocab = app.model.model().info.vocab;
            if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
                return Err(ApiError::invalid(
                    Some("prompt"),
                    format!("token {bad} is outside the vocabulary of {vocab}"),
                ));
            }
            ids
        }
        Prompt::TokenLists(_) => unreachable!("a batch of one was unwrapped above"),
    };
    // `echo`: the prompt comes back before the completion — as the client sent it, or the
    // text of its token ids — with each prompt token's log-probability when `logprobs` is on.
    // `max_tokens: 0` with `echo` scores the prompt alone (one token is generated, not shown).
    let echo = match (echo, &prompt) {
        (false, _) => None,
        (true, Prompt::Text(t)) => Some(t.clone()),
        (true, Prompt::Texts(v)) => Some(v.concat()),
        (true, _) => Some(decode(&app.tok, &ids).map_err(|e| server_error(e.to_string()))?),
    }
    .map(|text| Echo { text, hide: sampling.max_tokens == Some(0) });
    let hide = echo.as_ref().is_some_and(|e| e.hide);
    let mut request = sampling.request(ids, hide.then_some(1), 16, app.engine.info().vocab, logprobs)?;
    if echo.is_some() {
        request.prompt_logprobs = logprobs;
    }
    request.time_limit = app.request_timeout;
    run(app.clone(), app.reply(Kind::Completion), sampling.choices(request)?, &sampling, None, echo).await
}

async fn text_ids(app: &App, text: String) -> Result<Vec<u32>, ApiError> {
    let (model, tok) = (app.model.clone(), app.tok.clone());
    tokenize(move || {
        let mut ids = encode(&tok, &text).map_err(|e| e.to_string())?;
        with_bos(model.model(), &mut ids);
        Ok(ids)
    })
    .await
}

/// Tokenizes off the async workers (a long prompt takes milliseconds).
async fn tokenize(f: impl FnOnce() -> Result<Vec<u32>, String> + Send + 'static) -> Result<Vec<u32>, ApiError> {
    match tokio::task::spawn_blocking(f).await {
        Ok(Ok(ids)) => Ok(ids),
        Ok(Err(e)) => Err(ApiError::invalid(Some("prompt"), e)),
        Err(e) => Err(server_error(format!("tokenizing failed: {e}"))),
    }
}

fn server_error(message: String) -> ApiError {
    ApiError { status: 500, message, kind: "server_error", param: None, code: None, retry_after: None }
}

/// A choice's events, tagged with its index, from the engine's worker into its request's task
/// (one channel for all the choices). The receiver is dropped when the client goes away (hyper
/// drops the handler or the stream), which the engine sees as `alive() == false` and cancels.
struct ChannelSink(usize, UnboundedSender<(usize, Event)>);

impl Sink for ChannelSink {
    fn send(&mut self, e: Event) -> bool {
        self.1.send((self.0, e)).is_ok()
    }
    fn alive(&self) -> bool {
        !self.1.is_closed()
    }
}

/// How a chat request's replies are read for tool calls.
struct CallReader {
    tools: Tools,
    /// `false`: only a reply's first call is returned.
    parallel: bool,
}

impl CallReader {
    /// The calls of a finished reply (none when it is text).
    fn calls(&self, text: &str) -> Vec<Call> {
        let mut calls = self.tools.parse(text).unwrap_or_default();
        if !self.parallel {
            calls.truncate(1);
        }
        calls
    }
}

/// What a text completion's `echo` puts before each choice's completion.
struct Echo {
    /// The prompt.
    text: String,
    /// `max_tokens: 0`: the prompt alone (the one token generated is not shown or counted).
    hide: bool,
}

/// Runs a request's choices (each its own engine request, sampled with its own seed) and answers
/// with all of them, whole or streamed; with tools, a reply that is a call comes back as one.
/// `echo` (whole text completions only) puts the prompt, and its tokens' entries, first.
async fn run(
    app: Arc<App>,
    reply: Reply,
    requests: Vec<veloq_candle::engine::Request>,
    sampling: &Sampling,
    calls: Option<CallReader>,
    echo: Option<Echo>,
) -> Result<Response, ApiError> {
    let mut told = Told::new(&app, &reply.id);
    let active = Active::enter(&app.active);
    let mut waiting = Waiting::wait(&app.waiting, app.guards.max_queued).map_err(|e| told.refused(e))?;
    let (tx, mut rx) = unbounded_channel();
    let n = requests.len();
    // Each token's entry, per choice, while the request asked for them.
    let mut choices: Vec<Partial> =
        requests.iter().map(|r| Partial { logprobs: r.logprobs.map(|_| Vec::new()), ..Partial::default() }).collect();
    for (i, request) in requests.into_iter().enumerate() {
        // A refusal drops the receiver, which cancels the choices already submitted. A grammar
        // is compiled here (the first one builds the vocabulary's trie): off the async workers.
        let sink = Box::new(ChannelSink(i, tx.clone()));
        let submitted = match request.grammar {
            Some(_) => tokio::task::block_in_place(|| app.engine.submit(request, sink)),
            None => app.engine.submit(request, sink),
        };
        submitted
            .map_err(|r| match r {
                Rejected::Context { .. } => {
                    ApiError::invalid(Some("messages"), r.to_string()).with_code("context_length_exceeded")
                }
                Rejected::Budget { .. } => {
                    ApiError::invalid(Some("max_tokens"), r.to_string()).with_code("kv_budget_exceeded")
                }
                // A forced call's grammar comes from the tools, any other from the response format.
                Rejected::Grammar(m) if calls.as_ref().is_some_and(|c| c.tools.forces_call()) => {
                    ApiError::invalid(Some("tools"), m)
                }
                Rejected::Grammar(m) => ApiError::invalid(Some("response_format"), m),
                Rejected::Invalid(m) => ApiError::invalid(None, m),
                Rejected::Stopped => server_error(r.to_string()).status(503),
            })
            .map_err(|e| told.refused(e))?;
    }
    drop(tx);
    if sampling.stream {
        let usage = sampling.stream_usage();
        let state = Stream {
            rx,
            reply,
            pending: VecDeque::new(),
            ended: false,
            usage,
            app,
            waiting,
            choices,
            left: n,
            calls,
            told,
            _active: active,
        };
        return Ok(Sse::new(futures_util::stream::unfold(state, Stream::next))
            .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
            .into_response());
    }
    let mut left = n;
    let hide = echo.as_ref().is_some_and(|e| e.hide);
    while let Some((i, e)) = rx.recv().await {
        let c = &mut choices[i];
        match e {
            Event::Admitted => waiting.release(),
            Event::Text(_) | Event::Logprob(_) if hide => {}
            Event::Text(t) => c.text.push_str(&t),
            Event::Logprob(lp) => c.logprobs.iter_mut().for_each(|v| v.push(logprob_json(&app.tok, &lp))),
            Event::PromptLogprob(t, lp) => c.prompt.push(prompt_logprob_json(&app.tok, t, lp.as_ref())),
            Event::Done(mut s) => {
                app.log(&reply, i, &s);
                if hide {
                    (s.completion_tokens, s.finish) = (0, Finish::Length);
                }
                c.summary = Some(s);
                left -= 1;
                if left == 0 {
                    let echoed = echo.as_ref().map(|e| e.text.clone());
                    let mut done: Vec<Choice> = choices
                        .into_iter()
                        .filter_map(|mut c| {
                            if let Some(l) = c.logprobs.as_mut() {
                                l.splice(0..0, std::mem::take(&mut c.prompt));
                            }
                            let mut choice = c.finished()?;
                            choice.echo = echoed.clone();
                            Some(choice)
                        })
                        .collect();
                    if let Some(reader) = &calls {
                        done.iter_mut().for_each(|c| c.calls = reader.calls(&c.text));
                    }
                    told.ended = true;
                    return Ok(Json(reply.full(&done)).into_response());
                }
            }
            Event::Failed(why) => return Err(told.refused(server_error(why))),
        }
    }
    Err(told.refused(server_error("the engine stopped before the request ended".into())))
}

/// A request's log line when it ends without an answer: refused (by the queue's bound, the
/// engine, or a failure), or left by its client before the end (its handler or stream dropped).
/// A finished request's line is [`App::log`]'s.
struct Told {
    log: bool,
    id: String,
    ended: bool,
}

impl Told {
    fn new(app: &App, id: &str) -> Self {
        Self { log: app.log, id: id.to_string(), ended: false }
    }

    /// Logs why the request gets `e` instead of an answer, and passes `e` on.
    fn refused(&mut self, e: ApiError) -> ApiError {
        if self.log {
            eprintln!("{} refused ({}): {}", self.id, e.status, e.message);
        }
        self.ended = true;
        e
    }
}

impl Drop for Told {
    fn drop(&mut self) {
        if self.log && !self.ended {
            eprintln!("{} cancelled: the client left before the end", self.id);
        }
    }
}

/// A choice on its way.
#[derive(Default)]
struct Partial {
    /// Its text (whole responses), or what a stream holds back while it may be a tool call.
    text: String,
    /// A stream sends its text as it comes (it is not, or can no longer be, a tool call).
    flowing: bool,
    /// Entries gathered (whole responses) or not yet sent (streams).
    logprobs: Option<Vec<Value>>,
    /// Characters of the tokens whose entries a stream has sent (where the next ones start).
    placed: usize,
    /// The prompt tokens' entries (`echo` with `logprobs`).
    prompt: Vec<Value>,
    summary: Option<Summary>,
}

impl Partial {
    fn finished(self) -> Option<Choice> {
        Some(Choice { echo: None, text: self.text, summary: self.summary?, logprobs: self.logprobs, calls: Vec::new() })
    }
}

impl App {
    fn log(&self, r: &Reply, choice: usize, s: &Summary) {
        if self.log {
            eprintln!(
                "{}#{choice} prompt {} (cached {}) completion {} finish {:?} queued {:.0} ms first token {:.0} ms total {:.0} ms{}",
                r.id,
                s.prompt_tokens,
                s.cached_tokens,
                s.completion_tokens,
                s.finish,
                s.queued.as_secs_f64() * 1e3,
                s.first_token.as_secs_f64() * 1e3,
                s.total.as_secs_f64() * 1e3,
                match s.preemptions {
                    0 => String::new(),
                    n => format!(" preempted {n}×"),
                }
            );
        }
    }
}

/// A streamed response: chunks as the engine's events come (the choices' interleaved, each
/// tagged with its index), then the usage and `[DONE]` once every choice has ended.
struct Stream {
    rx: UnboundedReceiver<(usize, Event)>,
    reply: Reply,
    pending: VecDeque<SseEvent>,
    ended: bool,
    usage: bool,
    app: Arc<App>,
    waiting: Waiting,
    choices: Vec<Partial>,
    /// Choices not yet ended.
    left: usize,
    /// With tools: replies that start like a call are held back until they end.
    calls: Option<CallReader>,
    told: Told,
    _active: Active,
}

impl Stream {
    fn data(v: &Value) -> SseEvent {
        SseEvent::default().data(v.to_string())
    }

    /// Choice `i`'s entries gathered since its last chunk (the text of a token may come later
    /// than its entry: stop strings hold text back), with the characters of the tokens before.
    fn take_logprobs(&mut self, i: usize) -> (Option<Vec<Value>>, usize) {
        let c = &mut self.choices[i];
        let before = c.placed;
        let taken = c.logprobs.as_mut().map(std::mem::take);
        let chars = |e: &Value| e["token"].as_str().map_or(0, |t| t.chars().count());
        c.placed += taken.iter().flatten().map(chars).sum::<usize>();
        (taken, before)
    }

    async fn next(mut self) -> Option<(Result<SseEvent, Infallible>, Self)> {
        loop {
            if let Some(e) = self.pending.pop_front() {
                return Some((Ok(e), self));
            }
            if self.ended {
                return None;
            }
            let chat = self.reply.kind == Kind::Chat;
            match self.rx.recv().await {
                // A choice's role comes first, as soon as it runs.
                Some((i, Event::Admitted)) => {
                    self.waiting.release();
                    if chat {
                        self.pending.push_back(Self::data(&self.reply.chunk(i, None, true, None, None, 0)))
                    }
                }
                // Streams take no `echo`: nothing asks for the prompt's entries.
                Some((_, Event::PromptLogprob(..))) => {}
                Some((i, Event::Logprob(lp))) => {
                    let entry = logprob_json(&self.app.tok, &lp);
                    self.choices[i].logprobs.iter_mut().for_each(|v| v.push(entry.clone()));
                }
                Some((i, Event::Text(t))) => {
                    let c = &mut self.choices[i];
                    let text = if c.flowing || self.calls.is_none() {
                        t
                    } else {
                        c.text.push_str(&t);
                        if self.calls.as_ref().is_some_and(|r| r.tools.may_be_call(&c.text)) {
                            continue;
                        }
                        c.flowing = true;
                        std::mem::take(&mut c.text)
                    };
                    let (lp, at) = self.take_logprobs(i);
                    let chunk = self.reply.chunk(i, Some(&text), false, None, lp.as_deref(), at);
                    self.pending.push_back(Self::data(&chunk))
                }
                Some((i, Event::Done(s))) => {
                    self.app.log(&self.reply, i, &s);
                    let (lp, at) = self.take_logprobs(i);
                    let held = std::mem::take(&mut self.choices[i].text);
                    let calls = self.calls.as_ref().map(|r| r.calls(&held)).unwrap_or_default();
                    let reason = if calls.is_empty() { finish_reason(s.finish) } else { "tool_calls" };
                    if !calls.is_empty() {
                        self.pending.push_back(Self::data(&self.reply.tool_chunk(i, &calls)));
                    } else if !held.is_empty() {
                        self.pending.push_back(Self::data(&self.reply.chunk(i, Some(&held), false, None, None, 0)));
                    }
                    let end = self.reply.chunk(i, None, false, Some(reason), lp.as_deref(), at);
                    self.pending.push_back(Self::data(&end));
                    self.choices[i].summary = Some(s);
                    self.left -= 1;
                    if self.left > 0 {
                        continue;
                    }
                    if self.usage {
                        let summaries: Vec<&Summary> = self.choices.iter().filter_map(|c| c.summary.as_ref()).collect();
                        self.pending.push_back(Self::data(&self.reply.usage_chunk(Usage::of(&summaries))));
                    }
                    self.pending.push_back(SseEvent::default().data("[DONE]"));
                    self.ended = true;
                    self.told.ended = true;
                }
                Some((_, Event::Failed(why))) => {
                    let e = self.told.refused(server_error(why));
                    self.pending.push_back(Self::data(&e.body()));
                    self.pending.push_back(SseEvent::default().data("[DONE]"));
                    self.ended = true;
                }
                None => {
                    let e = self.told.refused(server_error("the engine stopped before the request ended".into()));
                    self.pending.push_back(Self::data(&e.body()));
                    self.ended = true;
                }
            }
        }
    }
}

async fn models(State(app): State<Arc<App>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_card(&app)]}))
}

async fn model(State(app): State<Arc<App>>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    if id != app.name {
        return Err(ApiError::invalid(Some("model"), format!("the model {id:?} does not exist"))
            .status(404)
            .with_code("model_not_found"));
    }
    Ok(Json(model_card(&app)))
}

fn model_card(app: &App) -> Value {
    let info = app.engine.info();
    // What admission reserves for a request reaching each length (prompt + max_tokens).
    let sequences: Vec<Value> = [256, 1024, 4096, info.max_context]
        .iter()
        .filter(|&&n| n <= info.max_context)
        .map(|&n| json!({"positions": n, "bytes": info.sequence_bytes(n)}))
        .collect();
    json!({
        "id": app.name,
        "object": "model",
        "created": app.created,
        "owned_by": "veloq",
        "veloq": {
            "kv_cache": info.method,
            "max_context": info.max_context,
            "max_sequences": info.slots,
            "kv_budget_bytes": info.kv_budget,
            "kv_bytes_per_position": info.bytes_per_position,
            "kv_shared_bytes": info.shared_bytes,
            "kv_sequence_bytes": sequences,
        },
    })
}

async fn metrics_text(State(app): State<Arc<App>>) -> Response {
    let body = metrics::render(app.engine.info(), &app.engine.stats(), &app.name);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], body).into_response()
}
