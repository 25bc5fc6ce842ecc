//! `Pipeline`: the edge's inference pipeline for requests the control plane's ASGI app took
//! (`--edge granian`, or the app mounted in another server). Python hands over the request
//! head and its body (or why it could not be read); the answer comes back as a `Response`,
//! its body relayed batch by batch, exactly as the Rust edge would have answered.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::bridge::{resolve, LoopBridge};
use super::edge::{edge_config, EdgeSettings};
use super::errors::Unauthorized;
use super::response::{Head, Response};
use super::router::{AbortOnCancel, Router};
use crate::bridge::exchange::{relay, Exchange};
use crate::edge::body::EdgeBody;
use crate::edge::keys::KEY_REQUIRED;
use crate::edge::{BodyError, Embedded};
use crate::headers::{header_map, header_pairs};

/// Header pairs as ASGI gives and takes them.
type Pairs = Vec<(Vec<u8>, Vec<u8>)>;
/// An answer as ASGI sends it: status, header pairs, body.
type Raw = (u16, Pairs, Vec<u8>);

#[pyclass(frozen, name = "Pipeline", module = "pdproxy._pdproxy")]
pub(crate) struct Pipeline {
    embedded: Arc<Embedded>,
    runtime: &'static tokio::runtime::Runtime,
    /// The loop the answers are handed to (the router's, bound on construction).
    bridge: Py<LoopBridge>,
    buffer_limit: usize,
    stall: std::time::Duration,
}

#[pymethods]
impl Pipeline {
    /// The pipeline of `router`'s engine, with the settings the edge would have; its answers
    /// go to the running loop.
    #[new]
    fn new(py: Python<'_>, router: PyRef<'_, Router>, settings: EdgeSettings) -> PyResult<Self> {
        let config = edge_config(settings, PathBuf::new(), 1.0, 1)?;
        let forward = &router.engine.config.forward;
        Ok(Self {
            bridge: router.bridge(py)?,
            buffer_limit: forward.stream_buffer_limit,
            stall: forward.stream_stall_timeout,
            embedded: Arc::new(Embedded::new(Arc::clone(&router.engine), config)),
            runtime: router.runtime,
        })
    }

    /// Whether a POST to `path` (as the client sent it) is an inference request.
    fn serves(&self, path: &str) -> bool {
        self.embedded.strategy(path).is_some()
    }

    /// Serves one inference request: `target` is its path and query as sent, `body` its body,
    /// or `None` with `body_error` (`too_large`, `timeout`, `broken`) saying why it could not be
    /// read, `client` the client's address. Resolves to the answer's `Response` (its `node` is
    /// empty: the access log and the trace already name it).
    #[pyo3(signature = (method, target, headers, body, body_error=None, client=None))]
    #[allow(clippy::too_many_arguments)]
    fn serve<'py>(
        &self,
        py: Python<'py>,
        method: &str,
        target: &str,
        headers: Vec<(Vec<u8>, Vec<u8>)>,
        body: Option<&[u8]>,
        body_error: Option<&str>,
        client: Option<(String, u16)>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let method = Method::from_bytes(method.as_bytes())
            .map_err(|_| PyValueError::new_err(format!("invalid HTTP method {method:?}")))?;
        let mut request = Request::builder()
            .method(method)
            .uri(target)
            .body(())
            .map_err(|e| PyValueError::new_err(format!("invalid request target {target:?}: {e}")))?;
        *request.headers_mut() = header_map(&headers);
        let (parts, ()) = request.into_parts();
        let strategy = self
            .embedded
            .strategy(parts.uri.path())
            .ok_or_else(|| PyValueError::new_err(format!("{} is not an inference path", parts.uri.path())))?;
        let body = match (body, body_error) {
            (Some(body), None) => Ok(Bytes::copy_from_slice(body)),
            (_, Some("too_large")) => Err(BodyError::TooLarge(None)),
            (_, Some("timeout")) => Err(BodyError::Timeout),
            _ => Err(BodyError::Broken),
        };
        let peer = client
            .and_then(|(host, port)| host.parse::<IpAddr>().ok().map(|ip| SocketAddr::new(ip, port)))
            .unwrap_or_else(|| SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0));
        let (bridge, bridge_for_response) = (self.bridge.clone_ref(py), self.bridge.clone_ref(py));
        let future = bridge.get().create_future(py)?;
        let exchange = Arc::new(Exchange::new(self.buffer_limit));
        let (embedded, reply, stall) = (Arc::clone(&self.embedded), future.clone().unbind(), self.stall);
        let for_task = Arc::clone(&exchange);
        let task = self.runtime.spawn(async move {
            let (head, body) = embedded.serve(parts, body, peer, strategy).await.into_parts();
            let (complete, stream) = match body {
                EdgeBody::Full(bytes) => (Some(bytes.unwrap_or_default()), None),
                streaming => (None, Some(streaming)),
            };
            let for_python = stream.is_some().then(|| Arc::clone(&for_task));
            bridge.get().submit(Box::new(move |py| {
                let head =
                    Head { status: head.status, headers: &head.headers, node: "", complete: complete.as_deref() };
                let built = Response::build(py, &head, for_python, bridge_for_response)
                    .and_then(|r| Ok(Py::new(py, r)?.into_any()));
                resolve(py, &reply, built);
            }));
            if let Some(stream) = stream {
                relay(&for_task, stream, stall).await;
            }
        });
        exchange.set_task(task.abort_handle());
        future.call_method1(pyo3::intern!(py, "add_done_callback"), (AbortOnCancel(exchange),))?;
        Ok(future)
    }

    /// Raises `Unauthorized` unless a request with these headers may be served (its key, or
    /// its tenant's): the inference routes the control plane serves itself (`GET /v1/models`).
    fn check_key(&self, headers: Vec<(Vec<u8>, Vec<u8>)>) -> PyResult<()> {
        if self.embedded.authorizes(&header_map(&headers)) {
            Ok(())
        } else {
            Err(Unauthorized::new_err(KEY_REQUIRED))
        }
    }

    /// Whether some origin may call the proxy from a browser (`--allow-origins`).
    #[getter]
    fn cors_enabled(&self) -> bool {
        self.embedded.cors_enabled()
    }

    /// A browser's CORS for a request, in one reading of its headers: `(preflight, headers)`.
    /// A preflight's whole answer as `(status, headers, body)` (204 with what is allowed, or 400
    /// `cors_refused`); for any other request `None`, and the headers its answer carries (the
    /// origin's permission; none for no origin or one not allowed).
    fn cors(&self, method: &str, path: &str, headers: Pairs) -> (Option<Raw>, Pairs) {
        let headers = header_map(&headers);
        let preflight =
            Method::from_bytes(method.as_bytes()).ok().and_then(|m| self.embedded.preflight(&m, path, &headers));
        if let Some(answer) = preflight {
            let (head, body) = answer.into_parts();
            let body = match body {
                EdgeBody::Full(bytes) => bytes.unwrap_or_default().to_vec(),
                _ => Vec::new(),
            };
            return (Some((head.status.as_u16(), header_pairs(&head.headers), body)), Vec::new());
        }
        (None, header_pairs(&self.embedded.cors_headers(path, &headers)))
    }

    /// Streams still running end (the proxy shuts down).
    fn shutdown(&self) {
        self.embedded.shutdown();
    }
}
