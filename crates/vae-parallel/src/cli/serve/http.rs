//! The HTTP API (axum on hyper; docs/serving.md and docs/openapi.yaml describe it): the routes,
//! the bearer token, the body cap and read timeout, the answer's formats, and the mapping of the
//! library's [`ErrorKind`] to a status with its one-line message.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use tokio::sync::{mpsc, oneshot};

use super::engine::{Engine, Job, Outcome};
use super::spec::{self, Kind, RequestOptions};
use crate::settings::Settings;
use crate::{CancelToken, Error, ErrorKind, RequestReport, Tensor, Vae, io};

/// The header that carries a request's options, as JSON.
pub const OPTIONS_HEADER: &str = "x-vae-options";
/// The header of a response that carries the request's report, as JSON.
pub const REPORT_HEADER: &str = "x-vae-report";

/// What every handler shares.
pub struct App {
    /// The queue into the group.
    pub engine: Engine,
    /// The models by configured name.
    pub models: Arc<Vec<(String, Vae)>>,
    /// `GET /v1/models`' answer.
    pub models_json: String,
    /// The service's settings (flags over `--config`), under every request's own.
    pub base: Settings,
    /// The bearer token every request but the probes must carry, if any.
    pub token: Option<Vec<u8>>,
    /// The largest request body, bytes.
    pub max_body: usize,
    /// How long a request body may take to arrive.
    pub body_timeout: Duration,
    /// The requests admitted and not yet answered, by id: cancelled when the grace period of a
    /// shutdown runs out.
    pub in_flight: Mutex<HashMap<u64, CancelToken>>,
    /// Permits to read a request body into memory: `--queue` + 1 (every place in the queue and
    /// the one running), so that the bodies held at once are bounded before the queue is seen.
    pub bodies: Arc<tokio::sync::Semaphore>,
    next_id: AtomicU64,
}

impl App {
    /// The shared state of the routes.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        engine: Engine,
        models: Arc<Vec<(String, Vae)>>,
        models_json: String,
        base: Settings,
        token: Option<Vec<u8>>,
        max_body: usize,
        body_timeout: Duration,
        queue: usize,
    ) -> Self {
        Self {
            engine,
            models,
            models_json,
            base,
            token,
            max_body,
            body_timeout,
            in_flight: Mutex::new(HashMap::new()),
            bodies: Arc::new(tokio::sync::Semaphore::new(queue + 1)),
            next_id: AtomicU64::new(0),
        }
    }

    /// Cancels every request admitted and not yet answered (a shutdown whose grace ran out).
    pub fn cancel_all(&self, reason: &str) {
        for token in self.in_flight.lock().unwrap_or_else(|e| e.into_inner()).values() {
            token.cancel(reason);
        }
    }
}

/// The routes.
pub fn router(app: Arc<App>) -> Router {
    let guarded = Router::new()
        .route("/v1/decode", post(decode))
        .route("/v1/encode", post(encode))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .layer(middleware::from_fn_with_state(Arc::clone(&app), require_token));
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .merge(guarded)
        .fallback(|| async { refusal(StatusCode::NOT_FOUND, "not_found", "no such route (see docs/serving.md)") })
        .with_state(app)
}

/// A refusal: the status, the one-line message as the body, its kind in `X-VAE-Error-Kind`.
fn refusal(status: StatusCode, kind: &str, line: &str) -> Response {
    let mut response = (status, format!("{line}\n")).into_response();
    if let Ok(kind) = HeaderValue::from_str(kind) {
        response.headers_mut().insert("x-vae-error-kind", kind);
    }
    response
}

/// The status for a library error, by its kind: the client's mistakes are 4xx, the service's
/// failures 5xx.
pub fn status_of(err: &Error) -> StatusCode {
    match err.kind() {
        ErrorKind::InvalidOption => StatusCode::BAD_REQUEST,
        ErrorKind::InvalidInput | ErrorKind::Unsupported => StatusCode::UNPROCESSABLE_ENTITY,
        ErrorKind::Group => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// A metrics label for a library error's kind.
fn kind_label(err: &Error) -> &'static str {
    match err.kind() {
        ErrorKind::InvalidInput => "invalid_input",
        ErrorKind::InvalidOption => "invalid_option",
        ErrorKind::Unsupported => "unsupported",
        ErrorKind::Model => "model",
        ErrorKind::Group => "group",
        ErrorKind::Execution => "execution",
        _ => "io",
    }
}

fn library_refusal(err: &Error) -> Response {
    refusal(status_of(err), kind_label(err), &err.to_line())
}

/// Constant-time comparison of the bearer token; `/healthz` and `/readyz` need none.
async fn require_token(State(app): State<Arc<App>>, request: Request, next: Next) -> Response {
    if let Some(expected) = &app.token {
        use subtle::ConstantTimeEq;
        let given = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
            .unwrap_or_default();
        if !bool::from(given.ct_eq(expected.as_slice())) {
            let what = if given.is_empty() { "a bearer token is required" } else { "the bearer token is wrong" };
            let mut response = refusal(StatusCode::UNAUTHORIZED, "unauthorized", what);
            response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            return response;
        }
    }
    next.run(request).await
}

async fn readyz(State(app): State<Arc<App>>) -> Response {
    if app.engine.ready.load(Ordering::Relaxed) {
        "ready\n".into_response()
    } else {
        refusal(StatusCode::SERVICE_UNAVAILABLE, "not_ready", "the group's ranks failed and could not be replaced")
    }
}

async fn models(State(app): State<Arc<App>>) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], app.models_json.clone()).into_response()
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    let text = app.engine.metrics.render(app.engine.ready.load(Ordering::Relaxed));
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

async fn decode(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    handle(app, Kind::Decode, headers, body).await
}

async fn encode(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    handle(app, Kind::Encode, headers, body).await
}

/// Cancels its request when dropped armed: the client left (hyper drops the handler, or the
/// stream of frames, when the connection closes).
struct CancelOnDrop {
    app: Arc<App>,
    id: u64,
    token: CancelToken,
    armed: bool,
    /// For the metrics: the request's model, kind and arrival.
    model: String,
    kind: Kind,
    arrived: Instant,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            self.token.cancel("the client disconnected");
            count(&self.app, &self.model, self.kind, "cancelled", self.arrived);
        }
        self.app.in_flight.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.id);
    }
}

/// Counts a request's end in the metrics.
fn count(app: &App, model: &str, kind: Kind, outcome: &str, arrived: Instant) {
    app.engine.metrics.request(model, kind.as_str(), outcome, arrived.elapsed().as_secs_f64());
}

async fn handle(app: Arc<App>, kind: Kind, headers: HeaderMap, body: Body) -> Response {
    let arrived = Instant::now();
    let response = admit(&app, kind, &headers, body, arrived).await;
    match response {
        Ok(response) => response,
        Err((model, response)) => {
            let outcome =
                response.headers().get("x-vae-error-kind").and_then(|v| v.to_str().ok()).unwrap_or("error").to_string();
            count(&app, &model, kind, &outcome, arrived);
            response
        }
    }
}

/// A refusal before the request ran, with the model it named (`unknown` when none or not
/// configured) for the metrics.
type Refused = (String, Response);

async fn admit(
    app: &Arc<App>,
    kind: Kind,
    headers: &HeaderMap,
    body: Body,
    arrived: Instant,
) -> Result<Response, Refused> {
    let unknown = |r: Response| ("unknown".to_string(), r);
    // The options first: a request that cannot be run is refused before its body is read.
    let text = match headers.get(OPTIONS_HEADER).map(|v| v.to_str()) {
        None => "",
        Some(Ok(text)) => text,
        Some(Err(_)) => {
            return Err(unknown(refusal(StatusCode::BAD_REQUEST, "invalid_option", "X-VAE-Options is not ASCII text")));
        }
    };
    let options =
        spec::parse_options(text).map_err(|m| unknown(refusal(StatusCode::BAD_REQUEST, "invalid_option", &m)))?;
    let Some((_, vae)) = app.models.iter().find(|(name, _)| *name == options.model) else {
        let names: Vec<&str> = app.models.iter().map(|(n, _)| n.as_str()).collect();
        let line = format!("unknown model {:?} (this service has: {})", options.model, names.join(", "));
        return Err(unknown(refusal(StatusCode::NOT_FOUND, "unknown_model", &line)));
    };
    let model = options.model.clone();
    let refuse = |r: Response| (model.clone(), r);
    // The options resolved now, so that a bad value is a 400 before the body is read.
    let resolved = match kind {
        Kind::Decode => options.decode(&app.base).map(drop),
        Kind::Encode => options.encode(&app.base).map(drop),
    };
    resolved.map_err(|e| refuse(library_refusal(&e)))?;
    if kind == Kind::Encode && options.response != spec::Response::Npy {
        let line = "an encode answers a .npy latent: `response` must be npy";
        return Err(refuse(refusal(StatusCode::BAD_REQUEST, "invalid_option", line)));
    }
    if options.fps == Some(0) {
        return Err(refuse(refusal(StatusCode::BAD_REQUEST, "invalid_option", "`fps` must be at least 1")));
    }
    // The body's size, from its header before any of it is read, then as it arrives.
    let too_large = || {
        let line = format!("the request body is larger than the service's cap of {} bytes (--max-body)", app.max_body);
        refusal(StatusCode::PAYLOAD_TOO_LARGE, "too_large", &line)
    };
    let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > app.max_body as u64) {
        return Err(refuse(too_large()));
    }
    // A permit to hold a body: none free means as many bodies as the queue can take are
    // already being read or waiting, so this one is refused before it is read.
    let Ok(permit) = Arc::clone(&app.bodies).try_acquire_owned() else {
        return Err(refuse(queue_full(app)));
    };
    let bytes = match tokio::time::timeout(app.body_timeout, axum::body::to_bytes(body, app.max_body)).await {
        Err(_) => {
            let line = format!("the request body did not arrive within {} s", app.body_timeout.as_secs());
            return Err(refuse(refusal(StatusCode::REQUEST_TIMEOUT, "timeout", &line)));
        }
        Ok(Err(e)) if is_length_limit(&e) => return Err(refuse(too_large())),
        Ok(Err(e)) => {
            let line = format!("the request body could not be read: {e}");
            return Err(refuse(refusal(StatusCode::BAD_REQUEST, "invalid_input", &line)));
        }
        Ok(Ok(bytes)) => bytes,
    };
    let input = spec::read_body(&bytes, kind).map_err(|e| refuse(library_refusal(&e)))?;
    drop(bytes);
    check_response(&options, vae, &input)
        .map_err(|m| refuse(refusal(StatusCode::UNPROCESSABLE_ENTITY, "invalid_input", &m)))?;

    let id = app.next_id.fetch_add(1, Ordering::Relaxed);
    let token = CancelToken::new();
    app.in_flight.lock().unwrap_or_else(|e| e.into_inner()).insert(id, token.clone());
    let mut guard = CancelOnDrop {
        app: Arc::clone(app),
        id,
        token: token.clone(),
        armed: true,
        model: model.clone(),
        kind,
        arrived,
    };
    let (reply, answer) = oneshot::channel();
    let streamed = kind == Kind::Decode && options.response == spec::Response::Frames;
    let (stream, chunks) = if streamed {
        let (tx, rx) = mpsc::channel(4);
        (Some(super::engine::Stream { to: tx, stall: app.body_timeout }), Some(rx))
    } else {
        (None, None)
    };
    let job = Job { kind, options: options.clone(), input, stream, cancel: token, reply, arrived };
    if let Err(refused) = app.engine.submit(job) {
        guard.armed = false;
        if let super::engine::Refused::Gone = refused {
            let line = "the service's group thread has ended: it can run no more requests";
            return Err(refuse(refusal(StatusCode::SERVICE_UNAVAILABLE, "unavailable", line)));
        }
        return Err(refuse(queue_full(app)));
    }
    // Queued (the queue bounds it from here): the permit is the next body's.
    drop(permit);
    if let Some(chunks) = chunks {
        return streamed_response(Arc::clone(app), chunks, answer, guard, model.clone(), arrived).await.map_err(refuse);
    }
    let outcome = answer.await;
    guard.armed = false;
    let response = answered(app, &options, outcome).await.map_err(refuse)?;
    count(app, &model, kind, "ok", arrived);
    Ok(response)
}

/// Whether reading a body failed on the cap (not on a broken connection or a malformed chunk).
fn is_length_limit(err: &axum::Error) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = cause {
        if e.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        cause = e.source();
    }
    false
}

/// 429 with `Retry-After` (the mean request's seconds, at least 1).
fn queue_full(app: &App) -> Response {
    let wait = app.engine.metrics.mean_seconds().max(1.0).ceil() as u64;
    let line = "the service's queue is full: retry later";
    let mut response = refusal(StatusCode::TOO_MANY_REQUESTS, "queue_full", line);
    response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(wait));
    response
}

/// Refuses, before the request is queued, an answer its output cannot take: an image format for
/// several images, a stream of frames from a family that does not stream or an image latent.
fn check_response(options: &RequestOptions, vae: &Vae, input: &Tensor) -> Result<(), String> {
    let dims = input.dims();
    let batch_of_one = dims.first() == Some(&1);
    match options.response {
        spec::Response::Npy => Ok(()),
        spec::Response::Png if batch_of_one && dims.len() == 4 => Ok(()),
        spec::Response::Png => {
            Err(format!("a png answer is one image: a [1, C, H, W] latent, not {dims:?}; ask npy or frames"))
        }
        spec::Response::Gif | spec::Response::Mp4 if batch_of_one && dims.len() == 5 => Ok(()),
        spec::Response::Gif | spec::Response::Mp4 => {
            Err(format!("a gif or mp4 answer is one video: a [1, C, T, H, W] latent, not {dims:?}"))
        }
        spec::Response::Frames if !vae.streams() => {
            Err(format!("the {} family does not stream its frames; ask npy", vae.class_name()))
        }
        spec::Response::Frames if dims.len() != 5 => {
            Err(format!("a stream of frames needs a video latent [B, C, T, H, W], not {dims:?}"))
        }
        spec::Response::Frames => Ok(()),
    }
}

/// The answer of a request that ran (or failed).
async fn answered(
    app: &App,
    options: &RequestOptions,
    outcome: Result<Outcome, oneshot::error::RecvError>,
) -> Result<Response, Response> {
    let (output, report, queued, ran) = match outcome {
        Ok(Outcome::Done { output, report, queued, ran }) => (output, report, queued, ran),
        Ok(Outcome::Failed(err)) => return Err(library_refusal(&err)),
        Ok(Outcome::Unavailable(why)) => {
            return Err(refusal(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                &format!("the group cannot run requests: {why}"),
            ));
        }
        Err(_) => return Err(refusal(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "the service is stopping")),
    };
    if let Some(report) = &report {
        app.engine.metrics.report(report);
    }
    let Some(output) = output else {
        return Err(refusal(StatusCode::INTERNAL_SERVER_ERROR, "execution", "the owner received no output"));
    };
    let response = options.response;
    let fps = options.fps.unwrap_or(crate::video::DEFAULT_FPS);
    let encoded = tokio::task::spawn_blocking(move || answer_bytes(response, &output, fps)).await;
    let (content_type, bytes) = match encoded {
        Ok(Ok(done)) => done,
        Ok(Err(err)) => return Err(library_refusal(&err)),
        Err(e) => {
            return Err(refusal(StatusCode::INTERNAL_SERVER_ERROR, "execution", &format!("encoding the answer: {e}")));
        }
    };
    let mut response = ([(header::CONTENT_TYPE, content_type)], bytes).into_response();
    add_report(response.headers_mut(), report.as_deref(), queued, ran);
    Ok(response)
}

/// The output as the asked format's bytes, as the CLI writes that file.
fn answer_bytes(response: spec::Response, output: &Tensor, fps: u32) -> Result<(&'static str, Vec<u8>), Error> {
    let (name, content_type) = match response {
        spec::Response::Npy | spec::Response::Frames => return Ok(("application/x-npy", io::npy_bytes(output)?)),
        spec::Response::Png => ("out.png", "image/png"),
        spec::Response::Gif => ("out.gif", "image/gif"),
        spec::Response::Mp4 => ("out.mp4", "video/mp4"),
    };
    // The CLI's writers, into a private directory: one file for a batch of one.
    let dir = tempfile::tempdir().map_err(|e| io::IoError::Unsupported(format!("a temporary directory: {e}")))?;
    let written = io::write_decoded(dir.path().join(name), output, fps)?;
    let [file] = written.as_slice() else {
        return Err(io::IoError::Unsupported(format!("the answer made {} files, not one", written.len())).into());
    };
    let bytes = std::fs::read(file).map_err(|source| io::IoError::Os { path: file.clone(), source })?;
    Ok((content_type, bytes))
}

/// The report (JSON, ASCII-only) and the times in the response's headers.
fn add_report(headers: &mut HeaderMap, report: Option<&RequestReport>, queued: Duration, ran: Duration) {
    if let Some(json) = report.and_then(|r| serde_json::to_string(r).ok())
        && let Ok(value) = HeaderValue::from_str(&ascii_json(&json))
    {
        headers.insert(REPORT_HEADER, value);
    }
    headers.insert("x-vae-queue-ms", HeaderValue::from(queued.as_millis() as u64));
    headers.insert("x-vae-run-ms", HeaderValue::from(ran.as_millis() as u64));
}

/// JSON with every character outside ASCII escaped (`\uXXXX`), fit for a header.
fn ascii_json(json: &str) -> String {
    let mut out = String::with_capacity(json.len());
    for c in json.chars() {
        if c.is_ascii() && !c.is_ascii_control() {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
        }
    }
    out
}

/// A streamed decode's answer: the status once the first frames arrive (or the refusal, when it
/// fails before any), then each run of frames as a `.npy` chunk. A failure after the first
/// frames ends the body early (the client sees a truncated stream, never a wrong frame).
async fn streamed_response(
    app: Arc<App>,
    mut chunks: mpsc::Receiver<Vec<u8>>,
    answer: oneshot::Receiver<Outcome>,
    mut guard: CancelOnDrop,
    model: String,
    arrived: Instant,
) -> Result<Response, Response> {
    let Some(first) = chunks.recv().await else {
        // No frames: the request failed (or, impossibly, had none).
        guard.armed = false;
        let options = RequestOptions::default();
        return match answered(&app, &options, answer.await).await {
            Ok(_) => Err(refusal(StatusCode::INTERNAL_SERVER_ERROR, "execution", "the decode streamed no frames")),
            Err(response) => Err(response),
        };
    };
    struct State {
        first: Option<Vec<u8>>,
        chunks: mpsc::Receiver<Vec<u8>>,
        answer: Option<oneshot::Receiver<Outcome>>,
        guard: CancelOnDrop,
        model: String,
        arrived: Instant,
    }
    let state = State { first: Some(first), chunks, answer: Some(answer), guard, model, arrived };
    let stream = futures_util::stream::unfold(state, |mut s| async move {
        if let Some(first) = s.first.take() {
            return Some((Ok::<Bytes, std::io::Error>(Bytes::from(first)), s));
        }
        if let Some(chunk) = s.chunks.recv().await {
            return Some((Ok(Bytes::from(chunk)), s));
        }
        // Every frame was sent: the request's end says whether they were all of them.
        let answer = s.answer.take()?;
        s.guard.armed = false;
        let app = Arc::clone(&s.guard.app);
        match answer.await {
            Ok(Outcome::Done { report, .. }) => {
                if let Some(report) = &report {
                    app.engine.metrics.report(report);
                }
                count(&app, &s.model, Kind::Decode, "ok", s.arrived);
                None
            }
            Ok(Outcome::Failed(err)) => {
                count(&app, &s.model, Kind::Decode, kind_label(&err), s.arrived);
                Some((Err(std::io::Error::other(err.to_line())), s))
            }
            _ => Some((Err(std::io::Error::other("the service is stopping")), s)),
        }
    });
    let mut response = Response::new(Body::from_stream(stream));
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/x-vae-frames"));
    Ok(response)
}

#[cfg(test)]
mod tests {
    use super::ascii_json;

    #[test]
    fn header_json_is_ascii() {
        assert_eq!(ascii_json(r#"{"r":"2×2 → ok"}"#), r#"{"r":"2\u00d72 \u2192 ok"}"#);
    }
}
