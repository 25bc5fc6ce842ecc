//! `Trace`: a place in a request's trace, for the control plane's requests (the Rust edge
//! traces its own). The request's root, or a span under it (a DistServe leg); routers forward
//! with one so their admission, selection and attempt spans land under it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use pyo3::prelude::*;

use crate::observe::trace::{OpenSpan, SpanKind, Trace as RequestTrace, Traced};

#[pyclass(frozen, name = "Trace", module = "pdproxy._pdproxy")]
pub(crate) struct Trace {
    request: Arc<RequestTrace>,
    /// `None`: the request's root span (ended when the last reference to the trace goes).
    span: Mutex<Option<OpenSpan>>,
    /// The span's id, kept after it ended (children may still name it).
    parent: Option<OpenSpan>,
}

impl Trace {
    pub(crate) fn root(trace: Arc<RequestTrace>) -> Self {
        Self { request: trace, span: Mutex::new(None), parent: None }
    }

    /// The trace, and the span under which its parts go.
    pub(crate) fn place(&self) -> (Arc<RequestTrace>, Option<OpenSpan>) {
        (Arc::clone(&self.request), self.parent)
    }
}

/// Spans of a request part under `span` (or the root).
pub(crate) fn traced<'a>(trace: &'a RequestTrace, span: Option<&OpenSpan>) -> Traced<'a> {
    match span {
        Some(span) => trace.traced().under(span),
        None => trace.traced(),
    }
}

#[pymethods]
impl Trace {
    /// The trace id (32 hex digits), as logs show it.
    #[getter]
    fn id(&self) -> String {
        self.request.id_hex()
    }

    /// Whether the trace is recorded (sampled) or only passed on.
    #[getter]
    fn sampled(&self) -> bool {
        self.request.sampled()
    }

    /// A span under this one (`name`: e.g. `pdproxy.prefill`); end it with `end`.
    fn child(&self, name: &str) -> Self {
        let name = known(&SPAN_NAMES, name, "pdproxy.step");
        let span = traced(&self.request, self.parent.as_ref()).open(name, SpanKind::Internal);
        Self { request: Arc::clone(&self.request), span: Mutex::new(Some(span)), parent: Some(span) }
    }

    /// Attributes of the request (on its root span).
    fn annotate(&self, attributes: HashMap<String, String>) {
        self.request.annotate(|| {
            attributes.into_iter().map(|(k, v)| (known(&ATTRIBUTES, &k, "pdproxy.attribute"), v)).collect()
        });
    }

    /// The request failed, with why.
    fn fail(&self, message: &str) {
        self.request.fail(message);
    }

    /// Ends this span (a child; the root ends with the request), with an error when it failed.
    #[pyo3(signature = (status=None, error=None))]
    fn end(&self, status: Option<u16>, error: Option<&str>) {
        if let Some(span) = self.span.lock().unwrap_or_else(PoisonError::into_inner).take() {
            let attributes = || status.map(|s| ("http.response.status_code", s.to_string())).into_iter().collect();
            self.request.end(span, attributes, error);
        }
    }
}

/// Span and attribute names the control plane uses (spans keep `&'static str` names).
const SPAN_NAMES: [&str; 2] = ["pdproxy.prefill", "pdproxy.decode"];
const ATTRIBUTES: [&str; 6] = [
    "http.request.method",
    "url.path",
    "http.response.status_code",
    "pdproxy.request_id",
    "pdproxy.model",
    "pdproxy.node",
];

fn known(names: &[&'static str], name: &str, otherwise: &'static str) -> &'static str {
    names.iter().find(|known| **known == name).copied().unwrap_or(otherwise)
}
