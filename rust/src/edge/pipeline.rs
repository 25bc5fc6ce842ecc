//! One pipeline for every inference request the edge serves, Hybrid or disaggregated. Its
//! phases run in order, each a method of `Pipeline`: check (key, gate, loop, media type,
//! coding, body), parse (the one inspection of the body), admit (the tenant's limits), then the
//! route's strategy (`Dispatch`: one node for Hybrid, a pair for each prefill/decode protocol)
//! chooses the nodes and sends, and respond relays the node's answer. A refusal at any phase
//! is a `Refusal` carried by `?` to `serve`, the one place that renders it.

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use futures_util::future::Either;
use futures_util::FutureExt;
use http::header::{HeaderName, HeaderValue, CONNECTION, CONTENT_LENGTH};
use http::request::Parts;
use http::{HeaderMap, Response, StatusCode};
use hyper::body::Incoming;

use super::answer::{self, Fault};
use super::body::{EdgeBody, Relay, RelayParts};
use super::error_answer;
use super::keys;
use super::notes::Notes;
use super::request::{
    check_media_type, content_coding, linger, plain_path, proxy_headers, read_body, BodyError, Peer, X_REQUEST_ID,
};
use super::worker::Worker;
use super::{EdgeState, PdProtocol};
use crate::distserve::Preserved;
use crate::engine::{select_ctx, GatePass, Refusal as GateRefusal, Sent};
use crate::error::{Error, Kind};
use crate::inspect::{inspect, RequestInfo};
use crate::node::Role;
use crate::observe::trace::{OpenSpan, SpanKind, Trace};
use crate::select::SelectCtx;
use crate::tenants::Class;
use crate::tenants::{estimate_tokens, Tenant};
use crate::upstream::forward::{ResponseBody, UpstreamResponse};
use crate::upstream::ForwardRequest;

/// A request's asked priority, when its body has none (smaller is served first).
static X_PDPROXY_PRIORITY: HeaderName = HeaderName::from_static("x-pdproxy-priority");

/// How the nodes of a request are chosen and its legs sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Strategy {
    /// One node; a pass-through path (`require_model`) needs a model in the body.
    Hybrid { require_model: bool },
    /// A prefill node and a decode node, in the protocol's way.
    Disaggregated(PdProtocol),
}

/// The answer a request gets instead of a node's: an OpenAI-style error.
#[derive(Debug)]
pub(crate) struct Refusal {
    pub(crate) fault: Fault,
    pub(crate) message: String,
    pub(crate) retry_after: Option<u32>,
    /// The request's field at fault, when one is.
    pub(crate) param: Option<&'static str>,
    /// Headers the answer carries besides the error's (a tenant's rate-limit headers).
    pub(crate) headers: Vec<(HeaderName, HeaderValue)>,
    /// The client's connection closes after the answer (its body was left unread).
    pub(crate) close: bool,
}

/// A refusal on its way to `serve` (boxed: it is the rare path, and keeps `Result`s small).
pub(crate) type Refused = Box<Refusal>;

impl Refusal {
    #[allow(clippy::unnecessary_box_returns)] // a refusal travels boxed, as `Refused`
    pub(crate) fn new(fault: Fault, message: impl Into<String>) -> Refused {
        Box::new(Self {
            fault,
            message: message.into(),
            retry_after: None,
            param: None,
            headers: Vec::new(),
            close: false,
        })
    }
}

impl From<Error> for Refused {
    fn from(error: Error) -> Self {
        let mut refusal = Refusal::new(answer::fault_of(&error), error.message());
        refusal.retry_after = error.retry_after();
        refusal.param = error.param();
        refusal
    }
}

/// What a strategy answers with.
pub(crate) enum Answer {
    /// A node's successful head: its body is relayed, with the permit held until it ends.
    Relay {
        sent: Sent,
        /// LMDeploy: the prefill's session, which the decode consumes.
        session: Option<Preserved>,
    },
    /// A node's whole answer, status and body unchanged (typically its error).
    Raw { status: StatusCode, headers: HeaderMap, body: Bytes },
}

/// A request that passed the checks, ready to send: its body read, its headers the node's.
struct Checked {
    pass: GatePass,
    request: ForwardRequest,
    /// The tenant its key belongs to, when tenants are configured.
    tenant: Option<Arc<Tenant>>,
}

/// An answered request, with what its answer needs to be relayed.
struct Served {
    answer: Answer,
    pass: GatePass,
    started: Instant,
    deadline: Option<tokio::time::Instant>,
}

/// What every strategy works with: the request, its routing fields, its trace and its class.
pub(crate) struct Dispatch<'a> {
    pub(crate) worker: &'a Worker,
    pub(crate) request: &'a ForwardRequest,
    pub(crate) info: &'a RequestInfo<'a>,
    pub(crate) trace: Option<&'a Arc<Trace>>,
    pub(crate) class: Class,
    /// The request's time limit, if it has one.
    pub(crate) deadline: Option<tokio::time::Instant>,
}

impl Dispatch<'_> {
    /// Selection for `role`, its spans under `span` (the leg's, else the request's).
    pub(crate) fn ctx(&self, role: Role, span: Option<&OpenSpan>) -> SelectCtx<'_> {
        let traced = self.trace.map(|t| t.traced());
        let trace = match span {
            Some(span) => traced.map(|t| t.under(span)),
            None => traced,
        };
        SelectCtx { trace, class: self.class, ..select_ctx(role, &self.request.headers, self.info) }
    }

    /// A leg's span, when traced.
    pub(crate) fn open_leg(&self, role: Role) -> Option<OpenSpan> {
        self.trace.map(|t| t.traced().open(leg_name(role), SpanKind::Internal))
    }

    async fn send(&self, strategy: Strategy) -> Result<Answer, Refused> {
        match strategy {
            Strategy::Hybrid { .. } => self.hybrid().await,
            Strategy::Disaggregated(PdProtocol::Lmdeploy) => self.lmdeploy().await,
            Strategy::Disaggregated(PdProtocol::Vllm) => self.vllm().await,
            Strategy::Disaggregated(PdProtocol::Sglang) => self.sglang().await,
        }
    }
}

pub(crate) fn leg_name(role: Role) -> &'static str {
    if role == Role::Prefill {
        "pdproxy.prefill"
    } else {
        "pdproxy.decode"
    }
}

/// A request's body: on the client's connection still, or already read by the server that
/// took the request (the control plane's, which hands inference requests here).
pub(crate) enum ClientBody {
    Incoming(Incoming),
    Read(Result<Bytes, BodyError>),
}

/// Serves one inference request through the pipeline.
pub(crate) async fn serve(
    worker: &Worker,
    peer: &Peer,
    parts: Parts,
    body: ClientBody,
    id: HeaderValue,
    had_id: bool,
    strategy: Strategy,
) -> Response<EdgeBody> {
    let mut notes = Notes::begin(&worker.state, &id, &parts, peer.address);
    let pipeline = Pipeline { worker, peer, id, had_id };
    match pipeline.run(parts, body, strategy, &mut notes).await {
        Ok(served) => pipeline.respond(served, notes),
        Err(refusal) => pipeline.refuse(&refusal, &mut notes),
    }
}

/// One request's way through the phases.
struct Pipeline<'a> {
    worker: &'a Worker,
    peer: &'a Peer,
    id: HeaderValue,
    /// The client sent its own request id.
    had_id: bool,
}

impl Pipeline<'_> {
    fn state(&self) -> &EdgeState {
        &self.worker.state
    }

    async fn run(
        &self,
        parts: Parts,
        body: ClientBody,
        strategy: Strategy,
        notes: &mut Notes,
    ) -> Result<Served, Refused> {
        let checked = self.check(parts, body).await?;
        let require_model = matches!(strategy, Strategy::Hybrid { require_model: true });
        let info = self.parse(&checked, require_model, notes)?;
        let class = Self::admit(&checked, &info, notes)?;
        let started = Instant::now();
        let deadline = self.state().engine.config.deadline(started);
        let dispatch = Dispatch {
            worker: self.worker,
            request: &checked.request,
            info: &info,
            trace: notes.trace.as_ref(),
            class,
            deadline,
        };
        let answer = within(deadline, dispatch.send(strategy)).await?;
        drop(info);
        Ok(Served { answer, pass: checked.pass, started, deadline })
    }

    /// The checks before the body is parsed: key, gate, loop, media type, coding, size and
    /// time of the body.
    async fn check(&self, parts: Parts, body: ClientBody) -> Result<Checked, Refused> {
        let state = self.state();
        let Ok(tenant) = state.authorize(&parts.headers) else {
            return Err(Refusal::new(answer::UNAUTHORIZED, keys::KEY_REQUIRED));
        };
        let pass = match state.engine.gate.pass() {
            Ok(pass) => pass,
            Err(GateRefusal::Draining) => {
                return Err(Refusal::new(answer::DRAINING, "the proxy is draining and takes no new requests"));
            }
            Err(GateRefusal::Full) => {
                let message =
                    format!("the proxy is serving its limit of {} requests", state.engine.gate.max_requests());
                return Err(Refusal::new(answer::PROXY_OVERLOADED, message));
            }
        };
        if crate::loops::came_back(&parts.headers, state.engine.instance()) {
            let message = "the request came back to this proxy: one of its nodes routes to it again";
            return Err(Refusal::new(answer::LOOP_DETECTED, message));
        }
        if let Err(media) = check_media_type(&parts.headers) {
            let message = format!("the request body must be JSON, not {media}");
            return Err(Refusal::new(answer::UNSUPPORTED_MEDIA_TYPE, message));
        }
        if let Some(coding) = content_coding(&parts.headers) {
            let message = format!("compressed request bodies are not accepted (content-encoding: {coding})");
            return Err(Refusal::new(answer::UNSUPPORTED_MEDIA_TYPE, message));
        }
        let limit = state.config.max_body_size;
        let read = match body {
            ClientBody::Incoming(body) => read_body(&parts.headers, body, limit, state.config.body_timeout).await,
            ClientBody::Read(Ok(body)) if body.len() > limit => Err(BodyError::TooLarge(None)),
            ClientBody::Read(read) => read,
        };
        let body = match read {
            Ok(body) => body,
            Err(BodyError::TooLarge(rest)) => {
                if let Some(rest) = rest {
                    tokio::spawn(linger(rest));
                }
                let mut refusal =
                    Refusal::new(answer::REQUEST_TOO_LARGE, format!("request body is larger than {limit} bytes"));
                refusal.close = true;
                return Err(refusal);
            }
            Err(BodyError::Timeout) => {
                let seconds = state.config.body_timeout.as_secs_f64();
                let message = format!("the request body did not arrive within {seconds}s");
                return Err(Refusal::new(answer::REQUEST_TIMEOUT, message));
            }
            Err(BodyError::Broken) => {
                return Err(Refusal::new(answer::INVALID_REQUEST, "the request body could not be read"));
            }
        };
        let Parts { method, uri, headers, .. } = parts;
        let request = ForwardRequest {
            method,
            path_and_query: uri.path_and_query().map_or_else(|| "/".to_owned(), |p| p.as_str().to_owned()),
            extra: proxy_headers(&headers, self.peer, &self.id, self.had_id, state.config.tls.is_some()),
            headers,
            body,
        };
        Ok(Checked { pass, request, tenant })
    }

    /// The body's routing fields; a pass-through path (`require_model`) needs a model.
    fn parse<'a>(
        &self,
        checked: &'a Checked,
        require_model: bool,
        notes: &mut Notes,
    ) -> Result<RequestInfo<'a>, Refused> {
        let path = checked.request.path_and_query.split('?').next().unwrap_or_default();
        if require_model && !plain_path(path) {
            let message = "the path may not contain dot-segments or encoded separators";
            return Err(Refusal::new(answer::INVALID_REQUEST, message));
        }
        let info = inspect(&checked.request.body)?;
        notes.model(info.model.as_deref());
        self.state().engine.check_asks(&info)?;
        if require_model && info.model.is_none() {
            return Err(Refusal::new(answer::NOT_FOUND, format!("no route for {path} without a model in the body")));
        }
        Ok(info)
    }

    /// The request's place in the queue: its priority (the body's `priority`, else the
    /// `x-pdproxy-priority` header, bounded by its tenant's limit) and its tenant, admitted
    /// within the tenant's limits.
    fn admit(checked: &Checked, info: &RequestInfo<'_>, notes: &mut Notes) -> Result<Class, Refused> {
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
                let mut refusal = Refusal::new(answer::limit_fault(limited.limit), limited.message);
                refusal.retry_after = Some(limited.retry_after);
                refusal.headers = limited.headers.to_headers().collect();
                Err(refusal)
            }
        }
    }

    /// The refusal as the client's answer, noted as the proxy's error.
    fn refuse(&self, refusal: &Refusal, notes: &mut Notes) -> Response<EdgeBody> {
        notes.refused(refusal.fault, &refusal.message);
        let mut response =
            error_answer::error_about(refusal.fault, &refusal.message, refusal.retry_after, refusal.param, &self.id);
        let headers = response.headers_mut();
        notes.decorate(headers);
        for (name, value) in &refusal.headers {
            headers.insert(name.clone(), value.clone());
        }
        if refusal.close {
            headers.insert(CONNECTION, HeaderValue::from_static("close"));
        }
        response
    }

    fn respond(&self, served: Served, mut notes: Notes) -> Response<EdgeBody> {
        let Served { answer, pass, started, deadline } = served;
        match answer {
            Answer::Relay { sent, session } => self.relay(sent, session, pass, notes, started, deadline),
            Answer::Raw { status, mut headers, body } => {
                headers.remove(CONTENT_LENGTH);
                headers.insert(X_REQUEST_ID.clone(), self.id.clone());
                notes.answered(None, status.as_u16());
                notes.decorate(&mut headers);
                notes.sent(&body, 0);
                notes.completed();
                let mut response = Response::new(EdgeBody::full(body));
                *response.status_mut() = status;
                *response.headers_mut() = headers;
                response
            }
        }
    }

    /// The client's answer from the node's: its status and headers (the request id echoed),
    /// and its body, whole or relayed with the permit held until it ends. A DistServe
    /// `session` is consumed once the answer is under way (its first data, or a whole
    /// successful answer).
    fn relay(
        &self,
        sent: Sent,
        session: Option<Preserved>,
        pass: GatePass,
        mut notes: Notes,
        started: Instant,
        deadline: Option<tokio::time::Instant>,
    ) -> Response<EdgeBody> {
        let Sent { mut permit, response } = sent;
        let outcome = response.outcome();
        let UpstreamResponse { status, headers: mut answer_headers, body } = response;
        if !answer_headers.contains_key(&X_REQUEST_ID) {
            answer_headers.insert(X_REQUEST_ID.clone(), self.id.clone());
        }
        notes.answered(Some(permit.node().url()), status.as_u16());
        notes.decorate(&mut answer_headers);
        let body = match body {
            ResponseBody::Complete(bytes) => {
                if let Some(session) = session.filter(|_| status.is_success()) {
                    session.consume();
                }
                permit.answered_whole(&bytes);
                permit.set_outcome(outcome);
                drop(permit);
                notes.sent(&bytes, 0);
                notes.completed();
                EdgeBody::full(bytes)
            }
            ResponseBody::Streaming(stream) => {
                let config = &self.state().engine.config.forward;
                let parts = RelayParts {
                    permit,
                    outcome_at_end: outcome,
                    event_stream: stream.event_stream,
                    idle_timeout: config.stream_idle_timeout,
                    held_limit: config.stream_buffer_limit,
                    deadline,
                    cut: Arc::clone(&self.state().shutdown),
                    started,
                    notes,
                    pass: Some(pass),
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
}

/// Runs `work` within the request's time limit, if it has one.
///
/// Combinators rather than an `async fn`: an `async fn` keeps its argument `work` beside the
/// timeout it moves `work` into, twice the size of the work (2.7 KiB more for every request in
/// flight, copied whenever the request's future moves).
pub(crate) fn within<T, E: From<Error>>(
    deadline: Option<tokio::time::Instant>,
    work: impl Future<Output = Result<T, E>>,
) -> impl Future<Output = Result<T, E>> {
    match deadline {
        Some(deadline) => Either::Left(tokio::time::timeout_at(deadline, work).map(|limited| {
            limited.unwrap_or_else(|_| {
                Err(Error::new(Kind::Timeout, "the request took longer than its time limit").into())
            })
        })),
        None => Either::Right(work),
    }
}
