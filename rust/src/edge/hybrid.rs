//! The fast path: an inference request served end to end in Rust (Hybrid serving: one node
//! per request). Checks in the control plane's order, one parse of the body, admission with
//! its permit, forwarding with retries, and the node's answer streamed straight back.

use std::sync::Arc;
use std::time::Instant;

use http::header::{HeaderValue, CONNECTION, CONTENT_TYPE};
use http::request::Parts;
use http::Response;
use hyper::body::Incoming;

use super::access::Record;
use super::answer::{self, Fault};
use super::body::{EdgeBody, Relay, RelayParts};
use super::request::{
    check_media_type, content_coding, linger, plain_path, proxy_headers, read_body, BodyError, Peer, X_REQUEST_ID,
};
use super::server::Worker;
use super::EdgeState;
use crate::engine::{select_ctx, GatePass, HeldPermit, PermitHolder, Refusal};
use crate::error::{Error, Kind};
use crate::forward::{ForwardRequest, ResponseBody, UpstreamResponse};
use crate::inspect::{inspect, RequestInfo};
use crate::node::{Node, Role};
use crate::sse;

/// A request that passed the checks, ready to forward: its body read, its headers the node's.
pub struct Checked {
    pub pass: GatePass,
    pub request: ForwardRequest,
}

/// A refusal: the answer to send instead (boxed: it is the rare path).
pub type Refused = Box<Response<EdgeBody>>;

/// The answer to a request the fast path refused, recorded as the proxy's error.
pub fn refuse(
    record: &mut Option<Box<Record>>,
    fault: Fault,
    message: &str,
    retry_after: Option<u32>,
    id: &HeaderValue,
) -> Response<EdgeBody> {
    let response = answer::error(fault, message, retry_after, id);
    if let Some(record) = record {
        record.status = Some(fault.status);
        record.proxy_error = Some(fault.code);
        record.complete = true;
    }
    response
}

/// A data-plane error as the answer, recorded.
pub fn refuse_error(record: &mut Option<Box<Record>>, error: &Error, id: &HeaderValue) -> Response<EdgeBody> {
    refuse(record, answer::fault_of(error), error.message(), error.retry_after(), id)
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
    record: &mut Option<Box<Record>>,
) -> Result<Checked, Refused> {
    if !state.keys.allows(&parts.headers) {
        let message = "a valid API key is required (Authorization: Bearer KEY, or x-api-key: KEY)";
        return Err(Box::new(refuse(record, answer::UNAUTHORIZED, message, None, id)));
    }
    let pass = match state.engine.gate.pass() {
        Ok(pass) => pass,
        Err(Refusal::Draining) => {
            let message = "the proxy is draining and takes no new requests";
            return Err(Box::new(refuse(record, answer::DRAINING, message, None, id)));
        }
        Err(Refusal::Full) => {
            let message = format!("the proxy is serving its limit of {} requests", state.engine.gate.max_requests());
            return Err(Box::new(refuse(record, answer::PROXY_OVERLOADED, &message, None, id)));
        }
    };
    if crate::loops::came_back(&parts.headers, state.engine.instance()) {
        let message = "the request came back to this proxy: one of its nodes routes to it again";
        return Err(Box::new(refuse(record, answer::LOOP_DETECTED, message, None, id)));
    }
    if let Err(media) = check_media_type(&parts.headers) {
        let message = format!("the request body must be JSON, not {media}");
        return Err(Box::new(refuse(record, answer::UNSUPPORTED_MEDIA_TYPE, &message, None, id)));
    }
    if let Some(coding) = content_coding(&parts.headers) {
        let message = format!("compressed request bodies are not accepted (content-encoding: {coding})");
        return Err(Box::new(refuse(record, answer::UNSUPPORTED_MEDIA_TYPE, &message, None, id)));
    }
    let limit = state.config.max_body_size;
    let body = match read_body(&parts.headers, body, limit, state.config.body_timeout).await {
        Ok(body) => body,
        Err(BodyError::TooLarge(rest)) => {
            if let Some(rest) = rest {
                tokio::spawn(linger(rest));
            }
            let message = format!("request body is larger than {limit} bytes");
            let mut response = refuse(record, answer::REQUEST_TOO_LARGE, &message, None, id);
            response.headers_mut().insert(CONNECTION, HeaderValue::from_static("close"));
            return Err(Box::new(response));
        }
        Err(BodyError::Timeout) => {
            let message =
                format!("the request body did not arrive within {}s", state.config.body_timeout.as_secs_f64());
            return Err(Box::new(refuse(record, answer::REQUEST_TIMEOUT, &message, None, id)));
        }
        Err(BodyError::Broken) => {
            let message = "the request body could not be read";
            return Err(Box::new(refuse(record, answer::INVALID_REQUEST, message, None, id)));
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
    Ok(Checked { pass, request })
}

/// The body's routing fields; a pass-through path (`require_model`) needs a model.
pub fn parse<'a>(
    checked: &'a Checked,
    require_model: bool,
    id: &HeaderValue,
    record: &mut Option<Box<Record>>,
) -> Result<RequestInfo<'a>, Refused> {
    let path = checked.request.path_and_query.split('?').next().unwrap_or_default();
    if require_model && !plain_path(path) {
        let message = "the path may not contain dot-segments or encoded separators";
        return Err(Box::new(refuse(record, answer::INVALID_REQUEST, message, None, id)));
    }
    let info = inspect(&checked.request.body).map_err(|e| Box::new(refuse_error(record, &e, id)))?;
    if let Some(record) = record {
        record.model = info.model.as_deref().map(str::to_owned);
    }
    if require_model && info.model.is_none() {
        let message = format!("no route for {path} without a model in the body");
        return Err(Box::new(refuse(record, answer::NOT_FOUND, &message, None, id)));
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
    let mut record = state.record(&id, &parts, peer.address);
    let checked = match check(state, peer, parts, body, &id, had_id, &mut record).await {
        Ok(checked) => checked,
        Err(refusal) => return *refusal,
    };
    let info = match parse(&checked, require_model, &id, &mut record) {
        Ok(info) => info,
        Err(refusal) => return *refusal,
    };
    let request = &checked.request;
    let ctx = select_ctx(Role::Hybrid, &request.headers, &info);
    let started = Instant::now();
    let deadline = state.engine.config.request_timeout.map(|t| tokio::time::Instant::now() + t);
    let held = HeldPermit::default();
    let sent = within(deadline, async {
        let permit = state.engine.permit(&ctx).await?;
        state.engine.send(&worker.forwarder, permit, request, &ctx, true, true, &held).await
    })
    .await;
    let (node, response) = match sent {
        Ok(answer) => answer,
        Err(e) => return refuse_error(&mut record, &e, &id),
    };
    drop(info);
    respond(state, &node, response, &held, &id, Some(checked.pass), record, started, deadline)
}

/// Runs `work` within the request's time limit, if it has one.
pub async fn within<T>(
    deadline: Option<tokio::time::Instant>,
    work: impl std::future::Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    match deadline {
        Some(deadline) => tokio::time::timeout_at(deadline, work)
            .await
            .unwrap_or_else(|_| Err(Error::new(Kind::Timeout, "the request took longer than its time limit"))),
        None => work.await,
    }
}

/// The client's answer from the node's: its status and headers (the request id echoed), and
/// its body, whole or relayed with the permit held until it ends.
#[allow(clippy::too_many_arguments)]
pub fn respond(
    state: &EdgeState,
    node: &Arc<Node>,
    response: UpstreamResponse,
    held: &HeldPermit,
    id: &HeaderValue,
    pass: Option<GatePass>,
    mut record: Option<Box<Record>>,
    started: Instant,
    deadline: Option<tokio::time::Instant>,
) -> Response<EdgeBody> {
    let outcome = response.outcome();
    let UpstreamResponse { status, headers: mut answer_headers, body } = response;
    if !answer_headers.contains_key(&X_REQUEST_ID) {
        answer_headers.insert(X_REQUEST_ID.clone(), id.clone());
    }
    if let Some(record) = &mut record {
        record.node = Some(node.url().to_owned());
        record.status = Some(status.as_u16());
    }
    let body = match body {
        ResponseBody::Complete(bytes) => {
            held.release(outcome);
            if let Some(record) = &mut record {
                record.sent(&bytes);
                record.complete = true;
            }
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
                record,
                pass,
            };
            EdgeBody::Relay(Box::new(Relay::new(stream.body, parts)))
        }
    };
    let mut answer = Response::new(body);
    *answer.status_mut() = status;
    *answer.headers_mut() = answer_headers;
    answer
}
