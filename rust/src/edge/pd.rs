//! Prefill/decode disaggregation: the pipeline's strategies for the three protocols. LMDeploy's
//! (prefill preserving the KV cache, decode migrating it by the session's handle, over a link
//! the control plane made), vLLM's (prefill with `kv_transfer_params`, then decode with the
//! prefill's params) and SGLang's (both legs at once, meeting in a bootstrap room). The pair of
//! nodes is chosen and both permits taken before anything is sent: decode first, then prefill,
//! always in that order, so two requests never hold one each while waiting for the other.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, StatusCode};
use serde_json::value::RawValue;

use super::answer::{INVALID_REQUEST, PREFILL_FAILED, UPSTREAM_INVALID_RESPONSE};
use super::pipeline::{leg_name, Answer, Dispatch, Refusal, Refused};
use super::PdProtocol;
use crate::distserve::{Preserved, SessionHandle};
use crate::engine::permit::InFlightPermit;
use crate::engine::{Engine, Sent};
use crate::error::{Error, Kind, Result};
use crate::inspect::{member, patch, RequestInfo};
use crate::node::Outcome;
use crate::node::{Node, Role};
use crate::observe::trace::{OpenSpan, SpanKind, Trace};
use crate::select::SelectCtx;
use crate::upstream::forward::{Forwarder, ResponseBody, UpstreamResponse};
use crate::upstream::ForwardRequest;

/// What the vLLM prefill leg asks for: keep the KV cache for a remote reader.
const VLLM_PREFILL_PARAMS: &str = r#"{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null}"#;

/// The prefill leg's body: the client's, asking for one token. LMDeploy's also keeps the KV
/// cache for the decode's migration (`with_cache`, `preserve_cache`); vLLM's asks for it to be
/// kept for a remote reader (`kv_transfer_params`). SGLang's legs share one body.
pub(crate) fn prefill_body(protocol: PdProtocol, path: &str, body: &[u8]) -> Result<Vec<u8>> {
    match protocol {
        PdProtocol::Lmdeploy => {
            let mut changes =
                vec![("max_tokens", "1"), ("stream", "false"), ("with_cache", "true"), ("preserve_cache", "true")];
            if path.starts_with("/v1/chat/") {
                changes.push(("max_completion_tokens", "1"));
            }
            patch(body, &changes, &["stream_options"])
        }
        PdProtocol::Vllm => {
            let mut changes =
                vec![("kv_transfer_params", VLLM_PREFILL_PARAMS), ("stream", "false"), ("max_tokens", "1")];
            if member(body, "max_completion_tokens")?.is_some() {
                changes.push(("max_completion_tokens", "1"));
            }
            // Not supported on the prefill leg, or meaningless for one token.
            patch(body, &changes, &["stream_options", "min_tokens", "min_completion_tokens"])
        }
        PdProtocol::Sglang => Ok(body.to_vec()),
    }
}

/// A permit taken for a leg not sent yet: given back uncounted if the request ends first.
struct Reserved(Option<InFlightPermit>);

impl Reserved {
    fn node(&self) -> &Arc<Node> {
        self.0.as_ref().expect("reserved").node()
    }

    fn take(mut self) -> InFlightPermit {
        self.0.take().expect("a reserved permit is taken once")
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        if let Some(permit) = self.0.take() {
            permit.unused();
        }
    }
}

impl Dispatch<'_> {
    /// The decode node's permit, then the prefill node's.
    async fn pair(&self) -> Result<(Reserved, Reserved)> {
        let engine = &self.worker.state.engine;
        let decode = Reserved(Some(engine.permit(&self.ctx(Role::Decode, None)).await?));
        let prefill = Reserved(Some(engine.permit(&self.ctx(Role::Prefill, None)).await?));
        self.note_held(decode.node(), prefill.node());
        Ok((decode, prefill))
    }

    /// On a recorded trace, what the KV index says the pair holds of the prompt: the prefill
    /// node is chosen for it (by `scored`); a decode node that holds the whole prompt could
    /// have served the request alone (a first step towards disaggregating only when it pays).
    fn note_held(&self, decode: &Node, prefill: &Node) {
        let Some(trace) = self.trace.filter(|t| t.sampled()) else { return };
        let (Some(index), Some(prompt)) = (self.worker.state.engine.kv_index(), self.ctx(Role::Decode, None).prompt)
        else {
            return;
        };
        let Some((prompt_bytes, held)) = index.held_of_request(prompt, &[decode.url(), prefill.url()]) else { return };
        trace.annotate(|| {
            let mut attributes = vec![("pdproxy.kv_index.prompt_bytes", prompt_bytes.to_string())];
            // A node the index is not live for gets no figure: unknown is not 0.
            if let Some(decode) = held[0] {
                attributes.push(("pdproxy.kv_index.decode_cached_tokens", decode.tokens.to_string()));
                attributes.push(("pdproxy.kv_index.decode_holds_prompt", decode.is_whole(prompt_bytes).to_string()));
            }
            if let Some(prefill) = held[1] {
                attributes.push(("pdproxy.kv_index.prefill_cached_tokens", prefill.tokens.to_string()));
            }
            attributes
        });
    }

    /// vLLM: the prefill first (`max_tokens=1`, its KV kept for the decode), then the decode
    /// with the prefill's `kv_transfer_params`, byte for byte. Both legs carry one request id.
    pub(super) async fn vllm(&self) -> Result<Answer, Refused> {
        if self.info.n.unwrap_or(1) > 1 {
            return Err(Refusal::new(INVALID_REQUEST, "n > 1 is not supported with disaggregated prefill"));
        }
        let engine = &self.worker.state.engine;
        let forwarder = &self.worker.forwarder;
        let (decode, prefill) = self.pair().await?;
        let body = prefill_body(PdProtocol::Vllm, &self.request.path_and_query, &self.request.body)?;
        let prefill_request = ForwardRequest { body: Bytes::from(body), ..self.request.clone() };
        let leg = self.open_leg(Role::Prefill);
        let ctx = self.ctx(Role::Prefill, leg.as_ref());
        let prefilled = async {
            let sent =
                engine.send(forwarder, prefill.take(), &prefill_request, &ctx, true, true, self.deadline).await?;
            whole(sent, forwarder).await
        }
        .await;
        end_leg(self.trace, leg, prefilled.as_ref().map(|(status, _, _)| *status));
        let (status, headers, raw) = prefilled?;
        if status != StatusCode::OK {
            return Ok(Answer::Raw { status, headers, body: raw }); // the prefill's error; decode never runs
        }
        let Ok(params) = member(&raw, "kv_transfer_params") else {
            return Err(Refusal::new(UPSTREAM_INVALID_RESPONSE, "the prefill node's answer is not a JSON object"));
        };
        let decode_body = match params {
            None | Some("null") => self.request.body.clone(),
            Some(params) => Bytes::from(patch(&self.request.body, &[("kv_transfer_params", params)], &[])?),
        };
        let decode_request = ForwardRequest { body: decode_body, ..self.request.clone() };
        let leg = self.open_leg(Role::Decode);
        let ctx = self.ctx(Role::Decode, leg.as_ref());
        let decoded = engine.send(forwarder, decode.take(), &decode_request, &ctx, true, true, self.deadline).await;
        end_leg(self.trace, leg, decoded.as_ref().map(|sent| sent.response.status));
        Ok(relay_or_raw(decoded?, forwarder).await?)
    }

    /// LMDeploy: the prefill (one token, its KV cache preserved) while the pair's link is made
    /// ready, then the decode with the session's `migration_request`; both nodes pinned, since
    /// the link is theirs. The session is consumed by the decode's first data and freed on the
    /// prefill node on any other ending.
    pub(super) async fn lmdeploy(&self) -> Result<Answer, Refused> {
        if self.info.n.unwrap_or(1) > 1 {
            return Err(Refusal::new(INVALID_REQUEST, "n > 1 is not supported with DistServe"));
        }
        let engine = &self.worker.state.engine;
        let forwarder = &self.worker.forwarder;
        let Some(distserve) = engine.distserve.load_full() else {
            return Err(Error::new(Kind::NoHealthyNode, "DistServe is not serving yet").into());
        };
        if distserve.config.dummy_prefill {
            let decode = Reserved(Some(engine.permit(&self.ctx(Role::Decode, None)).await?));
            return self.lmdeploy_decode(decode, &distserve.dummy_migration(), None).await;
        }
        let (decode, prefill) = self.pair().await?;
        let prefill_node = Arc::clone(prefill.node());
        let decode_url = decode.node().url().to_owned();
        let body = prefill_body(PdProtocol::Lmdeploy, &self.request.path_and_query, &self.request.body)?;
        let prefill_request = ForwardRequest { body: Bytes::from(body), ..self.request.clone() };
        // The link is made ready while the prefill runs, so the decode never waits for a handshake.
        let link = distserve.link(prefill_node.url(), &decode_url);
        tokio::pin!(link);
        let mut linked = None;
        let leg = self.open_leg(Role::Prefill);
        let ctx = self.ctx(Role::Prefill, leg.as_ref());
        let prefill_work = async {
            let sent =
                engine.send(forwarder, prefill.take(), &prefill_request, &ctx, false, true, self.deadline).await?;
            whole(sent, forwarder).await
        };
        tokio::pin!(prefill_work);
        let prefilled = loop {
            tokio::select! {
                done = &mut link, if linked.is_none() => linked = Some(done),
                prefilled = &mut prefill_work => break prefilled,
            }
        };
        end_leg(self.trace, leg, prefilled.as_ref().map(|(status, _, _)| *status));
        let (status, headers, raw) = prefilled?;
        if status != StatusCode::OK {
            return Ok(Answer::Raw { status, headers, body: raw }); // the prefill's error; decode never runs
        }
        let handle = SessionHandle::from_answer(&raw)?;
        let session = distserve.sessions.add(Arc::clone(&prefill_node), handle.session_id, Some(&decode_url));
        let session = Preserved::new(&distserve.sessions, session, forwarder.clone());
        match linked {
            Some(done) => done?,
            None => link.await?,
        }
        let migration = distserve.migration(prefill_node.url(), &handle);
        self.lmdeploy_decode(decode, &migration, Some(session)).await
    }

    /// LMDeploy's decode leg: the client's body with `migration_request`, on the reserved node.
    async fn lmdeploy_decode(
        &self,
        decode: Reserved,
        migration: &str,
        session: Option<Preserved>,
    ) -> Result<Answer, Refused> {
        let engine = &self.worker.state.engine;
        let forwarder = &self.worker.forwarder;
        let body = patch(&self.request.body, &[("migration_request", migration)], &[])?;
        let decode_request = ForwardRequest { body: Bytes::from(body), ..self.request.clone() };
        let leg = self.open_leg(Role::Decode);
        let ctx = self.ctx(Role::Decode, leg.as_ref());
        let decoded = engine.send(forwarder, decode.take(), &decode_request, &ctx, false, true, self.deadline).await;
        end_leg(self.trace, leg, decoded.as_ref().map(|sent| sent.response.status));
        match relay_or_raw(decoded?, forwarder).await? {
            Answer::Relay { sent, .. } => Ok(Answer::Relay { sent, session }),
            raw @ Answer::Raw { .. } => Ok(raw), // the session, unconsumed, is freed as it drops here
        }
    }

    /// SGLang: one body with the prefill node's bootstrap address and a fresh room, sent to
    /// both nodes at once (the prefill waits for the decode to join its room). The decode's
    /// answer is relayed, the prefill's read to its end; a leg that fails first cancels the other.
    pub(super) async fn sglang(&self) -> Result<Answer, Refused> {
        let engine = Arc::clone(&self.worker.state.engine);
        let forwarder = &self.worker.forwarder;
        let (decode, prefill) = self.pair().await?;
        let prefill_node = Arc::clone(prefill.0.as_ref().expect("reserved").node());
        let host = prefill_node.host().to_owned();
        let port = self.bootstrap_port(&prefill_node).await;
        let items = batch_size(&self.request.body, self.info)?;
        let one = |value: String| match items {
            None => value,
            Some(n) => format!("[{}]", vec![value; n].join(", ")),
        };
        let host_json = serde_json::Value::from(host.as_str()).to_string();
        let port_json = port.map_or_else(|| "null".to_owned(), |p| p.to_string());
        let rooms = match items {
            None => room().to_string(),
            Some(n) => format!("[{}]", (0..n).map(|_| room().to_string()).collect::<Vec<_>>().join(", ")),
        };
        let (host_json, port_json) = (one(host_json), one(port_json));
        let fields = [
            ("bootstrap_host", host_json.as_str()),
            ("bootstrap_port", port_json.as_str()),
            ("bootstrap_room", rooms.as_str()),
        ];
        let both = Arc::new(ForwardRequest {
            body: Bytes::from(patch(&self.request.body, &fields, &[])?),
            ..self.request.clone()
        });
        let trace = self.trace.cloned();
        let mut prefill_leg = Leg::spawn(
            Arc::clone(&engine),
            forwarder.clone(),
            prefill.take(),
            Arc::clone(&both),
            Role::Prefill,
            trace.clone(),
            self.deadline,
        );
        let mut decode_leg =
            Leg::spawn(Arc::clone(&engine), forwarder.clone(), decode.take(), both, Role::Decode, trace, self.deadline);
        let prefill_first = tokio::select! {
            biased;
            decoded = decode_leg.running() => Err(decoded),
            prefilled = prefill_leg.running() => Ok(prefilled),
        };
        let decoded = match prefill_first {
            Err(decoded) => decoded,
            Ok(prefilled) => match flatten(prefilled) {
                // The decode leg is dropped on return: cancelled.
                Err(e) => {
                    return Err(Refusal::new(PREFILL_FAILED, format!("the prefill node failed: {}", e.message())));
                }
                Ok(sent) if sent.response.status != StatusCode::OK => {
                    let status = sent.response.status;
                    return match whole(sent, forwarder).await {
                        Ok((status, headers, body)) if status.is_client_error() => {
                            Ok(Answer::Raw { status, headers, body })
                        }
                        _ => Err(prefill_failed(status)),
                    };
                }
                Ok(answered) => {
                    prefill_leg = Leg::Answered(Some(answered));
                    decode_leg.running().await
                }
            },
        };
        let sent = flatten(decoded)?;
        if sent.response.status == StatusCode::OK {
            tokio::spawn(prefill_leg.drain(forwarder.clone()));
        }
        // Otherwise the prefill leg is dropped here: cancelled.
        Ok(relay_or_raw(sent, forwarder).await?)
    }

    /// The prefill node's bootstrap port: declared at registration, else from its
    /// `/server_info` (`disaggregation_bootstrap_port`, asked once per node), else none (the
    /// decode node then assumes its own).
    async fn bootstrap_port(&self, node: &Arc<Node>) -> Option<u16> {
        /// Ports learnt per node (URL and generation): asked once.
        type Probed = Mutex<HashMap<(String, u64), Option<u16>>>;
        static PROBED: OnceLock<Probed> = OnceLock::new();
        if let Some(port) = node.spec().bootstrap_port {
            return Some(port);
        }
        let key = (node.url().to_owned(), node.generation());
        let probed = PROBED.get_or_init(Mutex::default);
        if let Some(port) = probed.lock().unwrap_or_else(PoisonError::into_inner).get(&key) {
            return *port;
        }
        let port = probe_bootstrap_port(&self.worker.forwarder, node, self.worker.state.config.pd_probe_timeout).await;
        probed.lock().unwrap_or_else(PoisonError::into_inner).insert(key, port);
        port
    }
}

#[allow(clippy::unnecessary_box_returns)] // a refusal travels boxed, as `Refused`
fn prefill_failed(status: StatusCode) -> Refused {
    Refusal::new(PREFILL_FAILED, format!("the prefill node answered {}", status.as_u16()))
}

/// The decode node's answer: relayed when it succeeded, whole otherwise.
async fn relay_or_raw(sent: Sent, forwarder: &Forwarder) -> Result<Answer> {
    if sent.response.status == StatusCode::OK {
        return Ok(Answer::Relay { sent, session: None });
    }
    let (status, headers, body) = whole(sent, forwarder).await?;
    Ok(Answer::Raw { status, headers, body })
}

/// A node's whole answer, read within the answer limits (size and time: past them the node's
/// connection is dropped); its permit is released with the answer's outcome.
async fn whole(sent: Sent, forwarder: &Forwarder) -> Result<(StatusCode, HeaderMap, Bytes)> {
    let Sent { mut permit, response } = sent;
    let outcome = response.outcome();
    let UpstreamResponse { status, headers, body } = response;
    let body = match body {
        ResponseBody::Complete(bytes) => bytes,
        ResponseBody::Streaming(stream) => match forwarder.read_answer(stream.body).await {
            Ok(bytes) => bytes,
            Err(e) => {
                permit.set_outcome(Outcome::Failed);
                return Err(e);
            }
        },
    };
    permit.answered_whole(&body);
    permit.set_outcome(outcome);
    Ok((status, headers, body))
}

/// What a leg ends with: its node's answer and permit.
type LegResult = Result<Sent>;

/// One leg of an SGLang request, running on its own task (aborted, its node's request
/// cancelled, when dropped), or its answer once it has come.
// Two legs per request, matched once each: boxing the answer would cost an allocation for nothing.
#[allow(clippy::large_enum_variant)]
enum Leg {
    Running(tokio::task::JoinHandle<LegResult>),
    Answered(Option<Sent>),
}

impl Leg {
    fn spawn(
        engine: Arc<Engine>,
        forwarder: Forwarder,
        permit: InFlightPermit,
        request: Arc<ForwardRequest>,
        role: Role,
        trace: Option<Arc<Trace>>,
        deadline: Option<tokio::time::Instant>,
    ) -> Self {
        Leg::Running(tokio::spawn(async move {
            let span = trace.as_deref().map(|t| t.traced().open(leg_name(role), SpanKind::Internal));
            let traced = trace.as_deref().zip(span.as_ref()).map(|(t, s)| t.traced().under(s));
            let ctx = SelectCtx { role, trace: traced, ..Default::default() };
            let sent = engine.send(&forwarder, permit, &request, &ctx, false, true, deadline).await;
            end_leg(trace.as_ref(), span, sent.as_ref().map(|sent| sent.response.status));
            sent
        }))
    }

    /// Waits for a running leg's answer (once).
    async fn running(&mut self) -> std::result::Result<LegResult, tokio::task::JoinError> {
        match self {
            Leg::Running(handle) => handle.await,
            Leg::Answered(answered) => Ok(answered.take().ok_or_else(|| Error::new(Kind::Upstream, "the leg ended"))),
        }
    }

    /// Reads the prefill's answer to its end: it carries nothing the client needs, but left
    /// unread it would hold the node.
    async fn drain(mut self, forwarder: Forwarder) {
        if let Ok(sent) = flatten(self.running().await) {
            let _ = whole(sent, &forwarder).await;
        }
    }
}

impl Drop for Leg {
    fn drop(&mut self) {
        if let Leg::Running(handle) = self {
            handle.abort();
        }
    }
}

/// Ends a leg's span: the node's status, or why the leg failed.
fn end_leg(trace: Option<&Arc<Trace>>, span: Option<OpenSpan>, result: std::result::Result<StatusCode, &Error>) {
    if let (Some(trace), Some(span)) = (trace, span) {
        let status = result.as_ref().ok().map(|s| ("http.response.status_code", s.as_str().to_owned()));
        let error = match result {
            Ok(status) if status.as_u16() >= 400 => Some(format!("the node answered {}", status.as_u16())),
            Ok(_) => None,
            Err(e) => Some(e.message().to_owned()),
        };
        trace.end(span, || status.into_iter().collect(), error.as_deref());
    }
}

fn flatten(joined: std::result::Result<LegResult, tokio::task::JoinError>) -> LegResult {
    joined.map_err(|_| Error::new(Kind::Upstream, "the leg was cancelled"))?
}

/// A fresh bootstrap room: a random 63-bit integer.
fn room() -> u64 {
    fastrand::u64(..) >> 1
}

/// Items in a batched request (an array prompt or text, or n > 1); `None` for one.
fn batch_size(body: &[u8], info: &RequestInfo<'_>) -> Result<Option<usize>> {
    if let Some(n) = info.n.filter(|&n| n > 1) {
        return Ok(Some(usize::try_from(n).unwrap_or(usize::MAX)));
    }
    for key in ["prompt", "text", "input_ids"] {
        let Some(raw) = member(body, key)? else { continue };
        if !raw.trim_start().starts_with('[') {
            continue;
        }
        let items: Vec<&RawValue> = serde_json::from_str(raw)
            .map_err(|e| Error::new(Kind::InvalidRequest, format!("{key} is not valid: {e}")))?;
        // A list of token ids is one prompt; a list of prompts is a batch.
        if !items.is_empty() && !items.iter().all(|i| i.get().parse::<i64>().is_ok()) {
            return Ok(Some(items.len()));
        }
    }
    Ok(None)
}

/// Asks a prefill node for its bootstrap port (`/server_info`, then `/get_server_info`).
async fn probe_bootstrap_port(forwarder: &Forwarder, node: &Node, timeout: Duration) -> Option<u16> {
    for endpoint in ["/server_info", "/get_server_info"] {
        let request = ForwardRequest {
            method: Method::GET,
            path_and_query: endpoint.to_owned(),
            headers: HeaderMap::new(),
            extra: Vec::new(),
            body: Bytes::new(),
        };
        let Ok(Ok(response)) = tokio::time::timeout(timeout, forwarder.forward(node, &request, true, None)).await
        else {
            continue;
        };
        if response.status != StatusCode::OK {
            continue;
        }
        let body = match response.body {
            ResponseBody::Complete(bytes) => bytes,
            // The whole probe, body included, within its timeout (not the answers' minute).
            ResponseBody::Streaming(stream) => {
                match tokio::time::timeout(timeout, forwarder.read_answer(stream.body)).await {
                    Ok(Ok(bytes)) => bytes,
                    _ => continue,
                }
            }
        };
        let port =
            serde_json::from_slice::<serde_json::Value>(&body).ok()?.get("disaggregation_bootstrap_port")?.as_u64();
        return port.and_then(|p| u16::try_from(p).ok());
    }
    None
}
