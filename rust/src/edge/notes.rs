//! What is kept about one request while the edge serves it: its access-log record, its trace
//! and its tenant's pass, each only when enabled. All are finished when the request's last
//! piece is dropped, so every ending (a client gone included) writes its line, exports its
//! spans and settles its tenant's tokens.

use std::net::SocketAddr;
use std::sync::Arc;

use http::header::HeaderValue;
use http::request::Parts;
use http::HeaderMap;

use super::answer::Fault;
use super::EdgeState;
use crate::observe::access::Record;
use crate::observe::trace::{self, Trace, TRACEPARENT};
use crate::tenants::TenantPass;

#[derive(Debug, Default)]
pub(crate) struct Notes {
    pub(crate) record: Option<Box<Record>>,
    pub(crate) trace: Option<Arc<Trace>>,
    /// The tenant's pass, once admitted (the answer's tokens are counted as it goes out).
    pub(crate) tenant: Option<TenantPass>,
}

impl Notes {
    /// The notes of a request arriving with `parts` from `peer`.
    pub(crate) fn begin(state: &EdgeState, id: &HeaderValue, parts: &Parts, peer: SocketAddr) -> Self {
        let mut record = state.record(id, parts, peer);
        if record.is_none() && state.engine.tracer.is_none() {
            return Self::default(); // nothing to note: not even a header lookup
        }
        let caller = parts.headers.get(&TRACEPARENT).map(HeaderValue::as_bytes);
        let trace = state.engine.tracer.as_ref().map(|tracer| tracer.begin(caller, "pdproxy.request"));
        if let Some(trace) = &trace {
            trace.annotate(|| {
                vec![
                    ("http.request.method", parts.method.as_str().to_owned()),
                    ("url.path", parts.uri.path().to_owned()),
                    ("pdproxy.request_id", id.to_str().unwrap_or_default().to_owned()),
                ]
            });
        }
        if let Some(record) = &mut record {
            // Untraced, the log still names the caller's trace.
            record.trace_id = match &trace {
                Some(trace) => Some(trace.id_hex()),
                None => caller.and_then(trace::trace_id_of),
            };
        }
        Self { record, trace, tenant: None }
    }

    /// The request's tenant admitted it.
    pub(crate) fn admitted(&mut self, pass: TenantPass) {
        if let Some(trace) = &self.trace {
            trace.annotate(|| vec![("pdproxy.tenant", pass.tenant().name.clone())]);
        }
        self.tenant = Some(pass);
    }

    /// Adds the tenant's `x-ratelimit-*` headers to an answer.
    pub(crate) fn decorate(&self, headers: &mut HeaderMap) {
        if let Some(pass) = &self.tenant {
            headers.reserve(6);
            for (name, value) in pass.headers.to_headers() {
                headers.insert(name, value);
            }
        }
    }

    /// The proxy answered instead of a node.
    pub(crate) fn refused(&mut self, fault: Fault, message: &str) {
        if let Some(pass) = &mut self.tenant {
            pass.fail();
        }
        if let Some(record) = &mut self.record {
            record.status = Some(fault.status);
            record.proxy_error = Some(fault.code);
            record.complete = true;
        }
        if let Some(trace) = &self.trace {
            trace.annotate(|| vec![("http.response.status_code", fault.status.to_string())]);
            trace.fail(message);
        }
    }

    pub(crate) fn model(&mut self, model: Option<&str>) {
        if let Some(record) = &mut self.record {
            record.model = model.map(str::to_owned);
        }
        if let (Some(trace), Some(model)) = (&self.trace, model) {
            trace.annotate(|| vec![("pdproxy.model", model.to_owned())]);
        }
    }

    /// A node's answer head (no node: a node's answer the proxy passes on whole).
    pub(crate) fn answered(&mut self, node: Option<&str>, status: u16) {
        if let (Some(pass), true) = (&mut self.tenant, status >= 500) {
            pass.fail();
        }
        if let Some(record) = &mut self.record {
            record.node = node.map(str::to_owned);
            record.status = Some(status);
        }
        if let Some(trace) = &self.trace {
            trace.annotate(|| {
                let mut out = vec![("http.response.status_code", status.to_string())];
                out.extend(node.map(|node| ("pdproxy.node", node.to_owned())));
                out
            });
            if status >= 500 {
                trace.fail("the node answered with an error");
            }
        }
    }

    /// Body bytes sent to the client, and the events they ended.
    pub(crate) fn sent(&mut self, chunk: &[u8], events: u64) {
        if let Some(record) = &mut self.record {
            record.sent(chunk);
        }
        if let Some(pass) = &mut self.tenant {
            pass.meter.observe(chunk, events);
        }
    }

    /// The whole answer was sent.
    pub(crate) fn completed(&mut self) {
        if let Some(record) = &mut self.record {
            record.complete = true;
        }
    }

    /// The stream ended with a terminal error event (`event`).
    pub(crate) fn stream_failed(&mut self, event: &[u8], message: &str) {
        if let Some(pass) = &mut self.tenant {
            pass.fail();
        }
        if let Some(record) = &mut self.record {
            record.sent(event);
            record.stream_error = true;
            record.complete = true;
        }
        if let Some(trace) = &self.trace {
            trace.fail(message);
        }
    }
}
