//! The fast path: an inference request served end to end in Rust (Hybrid serving: one node
//! per request). Checks in the control plane's order, one parse of the body, admission with
//! its permit, forwarding with retries, and the node's answer streamed straight back.

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use futures_util::future::Either;
use futures_util::FutureExt;

use http::header::{HeaderValue, CONNECTION, CONTENT_TYPE};
use http::request::Parts;
use http::Response;
use hyper::body::Incoming;

use super::answer::{self, Fault};
use super::body::{EdgeBody, Relay, RelayParts};
use super::notes::Notes;
use super::request::{
    check_media_type, content_coding, linger, plain_path, proxy_headers, read_body, BodyError, Peer, X_REQUEST_ID,
};
use super::server::Worker;
use super::EdgeState;
use crate::admission::Class;
use crate::distserve::Preserved;
use crate::engine::{select_ctx, GatePass, HeldPermit, PermitHolder, Refusal};
use crate::error::{Error, Kind};
use crate::forward::{ForwardRequest, ResponseBody, UpstreamResponse};
use crate::inspect::{inspect, RequestInfo};
use crate::node::{Node, Role};
use crate::select::SelectCtx;
use crate::sse;
use crate::tenants::{estimate_tokens, Tenant};

/// A request's asked priority, when its body has none (smaller is served first).
static X_PDPROXY_PRIORITY: http::HeaderName = http::HeaderName::from_static("x-pdproxy-priority");

/// A request that passed the checks, ready to forward: its body read, its headers the node's.
pub struct Checked {
    pub pass: GatePass,
    pub request: ForwardRequest,
    /// The tenant its key belongs to, when tenants are configured.
    pub tenant: Option<Arc<Tenant>>,
}

/// A refusal: the answer to send instead (boxed: it is the rare path).
pub type Refused = Box<Response<EdgeBody>>;

/// The answer to a request the fast path refused, noted as the proxy's error.
pub fn refuse(
    notes: &mut Notes,
    fault: Fault,
    message: &str,
    retry_after: Option<u32>,
    id: &HeaderValue,
) -> Response<EdgeBody> {
    refuse_about(notes, fault, message, retry_after, None, id)
}

fn refuse_about(
    notes: &mut Notes,
    fault: Fault,
    message: &str,
    retry_after: Option<u32>,
    param: Option<&str>,
    id: &HeaderValue,
) -> Response<EdgeBody> {
    notes.refused(fault, message);
    let mut response = answer::error_about(fault, message, retry_after, param, id);
    notes.decorate(response.headers_mut());
    response
}

/// A data-plane error as the answer, noted.
pub fn refuse_error(notes: &mut Notes, error: &Error, id: &HeaderValue) -> Response<EdgeBody> {
    refuse_about(notes, answer::fault_of(error), error.message(), error.retry_after(), error.param(), id)
}

/// The checks every fast-path request passes before its body is parsed: key, gate, media
/// type, size and time of the body. Refusals come back as the answer to send.
pub async fn check(
    state: &EdgeState,
    peer: &Peer,
    parts: Parts,
    body: Incoming,
    id: &HeaderValue,
    had_id: bool,
    notes: &mut Notes,
) -> Result<Checked, Refused> {
    let Ok(tenant) = state.authorize(&parts.headers) else {
        let message = "a valid API key is required (Authorization: Bearer KEY, or x-api-key: KEY)";
        return Err(Box::new(refuse(notes, answer::UNAUTHORIZED, message, None, id)));
    };
    let pass = match state.engine.gate.pass() {
        Ok(pass) => pass,
        Err(Refusal::Draining) => {
            let message = "the proxy is draining and takes no new requests";
            return Err(Box::new(refuse(notes, answer::DRAINING, message, None, id)));
        }
        Err(Refusal::Full) => {
            let message = format!("the proxy is serving its limit of {} requests", state.engine.gate.max_requests());
            return Err(Box::new(refuse(notes, answer::PROXY_OVERLOADED, &message, None, id)));
        }
    };
    if crate::loops::came_back(&parts.headers, state.engine.instance()) {
        let message = "the request came back to this proxy: one of its nodes routes to it again";
        return Err(Box::new(refuse(notes, answer::LOOP_DETECTED, message, None, id)));
    }
    if let Err(media) = check_media_type(&parts.headers) {
        let message = format!("the request body must be JSON, not {media}");
        return Err(Box::new(refuse(notes, answer::UNSUPPORTED_MEDIA_TYPE, &message, None, id)));
    }
    if let Some(coding) = content_coding(&parts.headers) {
        let message = format!("compressed request bodies are not accepted (content-encoding: {coding})");
        return Err(Box::new(refuse(notes, answer::UNSUPPORTED_MEDIA_TYPE, &message, None, id)));
    }
    let limit = state.config.max_body_size;
    let body = match read_body(&parts.headers, body, limit, state.config.body_timeout).await {
        Ok(body) => body,
        Err(BodyError::TooLarge(rest)) => {
            if let Some(rest) = rest {
                tokio::spawn(linger(rest));
            }
            let message = format!("request body is larger than {limit} bytes");
            let mut response = refuse(notes, answer::REQUEST_TOO_LARGE, &message, None, id);
            response.headers_mut().insert(CONNECTION, HeaderValue::from_static("close"));
            return Err(Box::new(response));
        }
        Err(BodyError::Timeout) => {
            let message =
                format!("the request body did not arrive within {}s", state.config.body_timeout.as_secs_f64());
            return Err(Box::new(refuse(notes, answer::REQUEST_TIMEOUT, &message, None, id)));
        }
        Err(BodyError::Broken) => {
            let message = "the request body could not be read";
            return Err(Box::new(refuse(notes, answer::INVALID_REQUEST, message, None, id)));
        }
    };
    let Parts { method, uri, headers, .. } = parts;
    let request = ForwardRequest {
        method,
        path_and_query: uri.path_and_query().map_or_else(|| "/".to_owned(), |p| p.as_str().to_owned()),
        extra: proxy_headers(&headers, peer, id, had_id, state.config.tls.is_some()),
        headers,
        body,
    };
    Ok(Checked { pass, request, tenant })
}

/// The request's place in the queue: its priority (the body's `priority`, else the
/// `x-pdproxy-priority` header, bounded by its tenant's limit) and its tenant, admitted within
/// the tenant's limits.
pub fn admit_tenant(
    checked: &Checked,
    info: &RequestInfo<'_>,
    notes: &mut Notes,
    id: &HeaderValue,
) -> Result<Class, Refused> {
    let asked = info.priority.or_else(|| {
        checked.request.headers.get(&X_PDPROXY_PRIORITY).and_then(|v| v.to_str().ok()?.trim().parse().ok())
    });
    let Some(tenant) = &checked.tenant else {
        return Ok(Class { priority: asked.unwrap_or(0), tenant: 0 });
    };
    let estimate = estimate_tokens(info.prompt.map_or(0, <[u8]>::len));
    match tenant.admit(estimate, asked) {
        Ok(pass) => {
            let class = pass.class;
            notes.admitted(pass);
            Ok(class)
        }
        Err(limited) => {
            let fault = answer::limit_fault(limited.limit);
            let mut response = refuse(notes, fault, &limited.message, Some(limited.retry_after), id);
            for (name, value) in limited.headers.to_headers() {
                response.headers_mut().insert(name, value);
            }
            Err(Box::new(response))
        }
    }
}

/// The body's routing fields; a pass-through path (`require_model`) needs a model.
pub fn parse<'a>(
    state: &EdgeState,
    checked: &'a Checked,
    require_model: bool,
    id: &HeaderValue,
    notes: &mut Notes,
) -> Result<RequestInfo<'a>, Refused> {
    let path = checked.request.path_and_query.split('?').next().unwrap_or_default();
    if require_model && !plain_path(path) {
        let message = "the path may not contain dot-segments or encoded separators";
        return Err(Box::new(refuse(notes, answer::INVALID_REQUEST, message, None, id)));
    }
    let info = inspect(&checked.request.body).map_err(|e| Box::new(refuse_error(notes, &e, id)))?;
    notes.model(info.model.as_deref());
    state.engine.check_asks(&info).map_err(|e| Box::new(refuse_error(notes, &e, id)))?;
    if require_model && info.model.is_none() {
        let message = format!("no route for {path} without a model in the body");
        return Err(Box::new(refuse(notes, answer::NOT_FOUND, &message, None, id)));
    }
    Ok(info)
}

/// Serves one hybrid inference request.
pub async fn serve(
    worker: &Worker,
    peer: &Peer,
    request: hyper::Request<Incoming>,
    id: HeaderValue,
    had_id: bool,
    require_model: bool,
) -> Response<EdgeBody> {
    let state = &worker.state;
    let (parts, body) = request.into_parts();
    let mut notes = Notes::begin(state, &id, &parts, peer.address);
    let checked = match check(state, peer, parts, body, &id, had_id, &mut notes).await {
        Ok(checked) => checked,
        Err(refusal) => return *refusal,
    };
    let info = match parse(state, &checked, require_model, &id, &mut notes) {
        Ok(info) => info,
        Err(refusal) => return *refusal,
    };
    let class = match admit_tenant(&checked, &info, &mut notes, &id) {
        Ok(class) => class,
        Err(refusal) => return *refusal,
    };
    let request = &checked.request;
    let ctx = SelectCtx { trace: notes.traced(), class, ..select_ctx(Role::Hybrid, &request.headers, &info) };
    let started = Instant::now();
    let deadline = state.engine.config.deadline(started);
    let held = HeldPermit::default();
    let sent = within(deadline, async {
        let permit = state.engine.permit(&ctx).await?;
        state.engine.send(&worker.forwarder, permit, request, &ctx, true, true, &held).await
    })
    .await;
    let (node, response) = match sent {
        Ok(answer) => answer,
        Err(e) => return refuse_error(&mut notes, &e, &id),
    };
    drop(info);
    respond(state, &node, response, &held, &id, Some(checked.pass), notes, started, deadline, None)
}

/// Runs `work` within the request's time limit, if it has one.
///
/// Combinators rather than an `async fn`: an `async fn` keeps its argument `work` beside the
/// timeout it moves `work` into, twice the size of the work (2.7 KiB more for every request in
/// flight, copied whenever the request's future moves).
pub fn within<T>(
    deadline: Option<tokio::time::Instant>,
    work: impl Future<Output = Result<T, Error>>,
) -> impl Future<Output = Result<T, Error>> {
    match deadline {
        Some(deadline) => Either::Left(tokio::time::timeout_at(deadline, work).map(|limited| {
            limited.unwrap_or_else(|_| Err(Error::new(Kind::Timeout, "the request took longer than its time limit")))
        })),
        None => Either::Right(work),
    }
}

/// The client's answer from the node's: its status and headers (the request id echoed), and
/// its body, whole or relayed with the permit held until it ends. A DistServe `session` is
/// consumed once the answer is under way (its first data, or a whole successful answer).
#[allow(clippy::too_many_arguments)]
pub fn respond(
    state: &EdgeState,
    node: &Arc<Node>,
    response: UpstreamResponse,
    held: &HeldPermit,
    id: &HeaderValue,
    pass: Option<GatePass>,
    mut notes: Notes,
    started: Instant,
    deadline: Option<tokio::time::Instant>,
    session: Option<Preserved>,
) -> Response<EdgeBody> {
    let outcome = response.outcome();
    let UpstreamResponse { status, headers: mut answer_headers, body } = response;
    if !answer_headers.contains_key(&X_REQUEST_ID) {
        answer_headers.insert(X_REQUEST_ID.clone(), id.clone());
    }
    notes.answered(Some(node.url()), status.as_u16());
    notes.decorate(&mut answer_headers);
    let body = match body {
        ResponseBody::Complete(bytes) => {
            if let Some(session) = session.filter(|_| status.is_success()) {
                session.consume();
            }
            held.release(outcome);
            notes.sent(&bytes, 0);
            notes.completed();
            EdgeBody::full(bytes)
        }
        ResponseBody::Streaming(stream) => {
            let Some(permit) = held.take() else {
                return answer::error(answer::INTERNAL, "the request lost its node", None, id);
            };
            let event_stream = answer_headers.get(CONTENT_TYPE).is_some_and(|ct| sse::is_event_stream(ct.as_bytes()));
            let parts = RelayParts {
                permit,
                outcome_at_end: outcome,
                event_stream,
                idle_timeout: state.engine.config.forward.stream_idle_timeout,
                held_limit: state.engine.config.forward.stream_buffer_limit,
                deadline,
                cut: Arc::clone(&state.shutdown),
                started,
                notes,
                pass,
                session,
            };
            EdgeBody::Relay(Box::new(Relay::new(stream.body, parts)))
        }
    };
    let mut answer = Response::new(body);
    *answer.status_mut() = status;
    *answer.headers_mut() = answer_headers;
    answer
}
