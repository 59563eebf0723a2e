//! What stands between the network and the endpoints: API keys (Bearer, on `/v1/*`), CORS
//! (preflights answered, the allowed origin echoed), and the bound on requests waiting for
//! admission (429 with `Retry-After` beyond it), so a deployment can face browsers and load.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::api::ApiError;

/// The guards' settings.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Guards {
    /// Keys a client may send as `Authorization: Bearer <key>`; none = no authentication.
    pub api_keys: Vec<String>,
    /// Origins whose browsers may call the API (`*` for any); none = no CORS headers.
    pub cors_origins: Vec<String>,
    /// Requests waiting for admission at most; one arriving while this many wait gets a 429.
    pub max_queued: Option<usize>,
}

impl Guards {
    /// The `Access-Control-Allow-Origin` value for a request from `origin`, when allowed.
    fn allow(&self, origin: Option<&HeaderValue>) -> Option<HeaderValue> {
        if self.cors_origins.iter().any(|o| o == "*") {
            return Some(HeaderValue::from_static("*"));
        }
        let origin = origin?;
        self.cors_origins.iter().any(|o| o.as_bytes() == origin.as_bytes()).then(|| origin.clone())
    }

    fn authorised(&self, req: &Request) -> bool {
        if self.api_keys.is_empty() || !req.uri().path().starts_with("/v1/") {
            return true;
        }
        let given = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
        let key = given.and_then(|v| v.strip_prefix("Bearer ")).map(str::trim);
        key.is_some_and(|k| self.api_keys.iter().any(|a| a == k))
    }
}

/// What the middleware reads: the settings, and whether the server is shutting down.
pub(crate) struct Gate {
    pub guards: Guards,
    pub draining: Arc<AtomicBool>,
}

/// The middleware: preflight, then the key, then the route; the CORS header on every answer.
pub(crate) async fn guard(State(gate): State<Arc<Gate>>, req: Request, next: Next) -> Response {
    let g = &gate.guards;
    let allowed = g.allow(req.headers().get(header::ORIGIN));
    let draining = gate.draining.load(Ordering::SeqCst) && req.uri().path().starts_with("/v1/");
    if req.method() == Method::OPTIONS && req.headers().contains_key(header::ACCESS_CONTROL_REQUEST_METHOD) {
        if let Some(origin) = allowed {
            let headers = req
                .headers()
                .get(header::ACCESS_CONTROL_REQUEST_HEADERS)
                .cloned()
                .unwrap_or_else(|| HeaderValue::from_static("authorization, content-type"));
            return (
                StatusCode::NO_CONTENT,
                [
                    (header::ACCESS_CONTROL_ALLOW_ORIGIN, origin),
                    (header::ACCESS_CONTROL_ALLOW_METHODS, HeaderValue::from_static("GET, POST, OPTIONS")),
                    (header::ACCESS_CONTROL_ALLOW_HEADERS, headers),
                    (header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600")),
                    (header::VARY, HeaderValue::from_static("Origin")),
                ],
            )
                .into_response();
        }
    }
    let mut resp = if draining {
        let e = ApiError::invalid(None, "the server is shutting down").status(503).with_code("shutting_down");
        e.retry_after(5).into_response()
    } else if g.authorised(&req) {
        next.run(req).await
    } else {
        let e = ApiError::invalid(None, "a valid API key is needed: Authorization: Bearer <key>");
        let mut r = e.status(401).with_code("invalid_api_key").into_response();
        r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        r
    };
    if let Some(origin) = allowed {
        resp.headers_mut().insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
        resp.headers_mut().insert(header::VARY, HeaderValue::from_static("Origin"));
    }
    resp
}

/// One request counted in a gauge until it is released or dropped: requests in flight (their
/// handler or stream alive; shutdown waits for them) and requests waiting for admission.
pub(crate) struct Counted(Option<Arc<AtomicUsize>>);

/// A request in flight.
pub(crate) type Active = Counted;
/// A request waiting for admission.
pub(crate) type Waiting = Counted;

impl Counted {
    /// Counts a request in.
    pub(crate) fn enter(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        Self(Some(count.clone()))
    }

    /// Counts a request in as waiting, or refuses it when `max` already wait.
    pub(crate) fn wait(count: &Arc<AtomicUsize>, max: Option<usize>) -> Result<Self, ApiError> {
        let before = count.fetch_add(1, Ordering::SeqCst);
        let c = Self(Some(count.clone()));
        match max {
            Some(m) if before >= m => {
                drop(c);
                Err(ApiError::invalid(None, format!("{before} requests are already waiting; retry shortly"))
                    .status(429)
                    .with_code("queue_full")
                    .retry_after(1))
            }
            _ => Ok(c),
        }
    }

    /// The request no longer counts (a waiting one was admitted).
    pub(crate) fn release(&mut self) {
        if let Some(c) = self.0.take() {
            c.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.release();
    }
}
