//! Every error the proxy answers itself: its status, `OpenAI` `type` and `code`, the `OpenAI`
//! error envelope (the control plane's answers are written here too, `pdproxy/errors.py`), and
//! the terminal event of a stream that failed. `error_answer` makes them responses.

use bytes::Bytes;
use serde::Serialize;

use crate::error::{Error, Kind};
use crate::tenants::Limit;

/// One kind of error answer: its status, `OpenAI` `type` and `code`, and default `Retry-After`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fault {
    pub(crate) status: u16,
    pub(crate) kind: &'static str,
    pub(crate) code: &'static str,
    pub(crate) retry_after: Option<u32>,
}

const fn fault(status: u16, kind: &'static str, code: &'static str, retry_after: Option<u32>) -> Fault {
    Fault { status, kind, code, retry_after }
}

pub(crate) const INTERNAL: Fault = fault(500, "internal_error", "internal_error", None);
pub(crate) const INVALID_CONFIG: Fault = fault(500, "internal_error", "invalid_config", None);
pub(crate) const INVALID_REQUEST: Fault = fault(400, "invalid_request_error", "invalid_request", None);
pub(crate) const REQUEST_TOO_LARGE: Fault = fault(413, "invalid_request_error", "request_too_large", None);
pub(crate) const REQUEST_TIMEOUT: Fault = fault(408, "invalid_request_error", "request_timeout", None);
pub(crate) const UNSUPPORTED_MEDIA_TYPE: Fault = fault(415, "invalid_request_error", "unsupported_media_type", None);
pub(crate) const NOT_FOUND: Fault = fault(404, "invalid_request_error", "not_found", None);
pub(crate) const METHOD_NOT_ALLOWED: Fault = fault(405, "invalid_request_error", "method_not_allowed", None);
pub(crate) const CORS_REFUSED: Fault = fault(400, "invalid_request_error", "cors_refused", None);
pub(crate) const UNAUTHORIZED: Fault = fault(401, "authentication_error", "unauthorized", None);
pub(crate) const FORBIDDEN: Fault = fault(403, "permission_error", "forbidden", None);
pub(crate) const DRAINING: Fault = fault(503, "service_unavailable", "draining", Some(1));
pub(crate) const INVALID_NODE: Fault = fault(400, "invalid_request_error", "invalid_node", None);
pub(crate) const NODE_NOT_FOUND: Fault = fault(404, "invalid_request_error", "node_not_found", None);
pub(crate) const REGISTRY_UNAVAILABLE: Fault = fault(503, "service_unavailable", "registry_unavailable", None);
/// The SGLang gateway's `POST /workers` for a URL already registered.
pub(crate) const WORKER_EXISTS: Fault = fault(409, "invalid_request_error", "worker_already_exists", None);
pub(crate) const DISTSERVE_OFF: Fault = fault(404, "invalid_request_error", "distserve_off", None);
pub(crate) const NO_HEALTHY_NODE: Fault = fault(503, "service_unavailable", "no_healthy_node", Some(1));
pub(crate) const MODEL_NOT_FOUND: Fault = fault(404, "invalid_request_error", "model_not_found", None);
pub(crate) const OVERLOADED: Fault = fault(429, "rate_limit_error", "overloaded", Some(1));
pub(crate) const OVER_REQUEST_RATE: Fault = fault(429, "requests", "rate_limit_exceeded", None);
pub(crate) const OVER_TOKEN_RATE: Fault = fault(429, "tokens", "rate_limit_exceeded", None);
pub(crate) const OVER_BUDGET: Fault = fault(429, "insufficient_quota", "insufficient_quota", None);
pub(crate) const PROXY_OVERLOADED: Fault = fault(503, "service_unavailable", "overloaded", Some(1));
pub(crate) const LOOP_DETECTED: Fault = fault(508, "server_error", "loop_detected", None);
pub(crate) const UPSTREAM_ERROR: Fault = fault(502, "upstream_error", "upstream_error", None);
pub(crate) const UPSTREAM_CONNECT_FAILED: Fault = fault(503, "upstream_error", "upstream_connect_failed", Some(1));
pub(crate) const UPSTREAM_TIMEOUT: Fault = fault(504, "upstream_error", "upstream_timeout", None);
pub(crate) const TERMINATE_FAILED: Fault = fault(502, "upstream_error", "terminate_failed", None);
pub(crate) const UPSTREAM_INVALID_RESPONSE: Fault = fault(502, "upstream_error", "upstream_invalid_response", None);
pub(crate) const PREFILL_FAILED: Fault = fault(502, "upstream_error", "prefill_failed", None);
pub(crate) const PD_LINK_FAILED: Fault = fault(502, "upstream_error", "pd_link_failed", None);
/// Past `--max-connections`: answered at accept, before the request is read.
pub(crate) const TOO_MANY_CONNECTIONS: Fault = fault(503, "service_unavailable", "overloaded", Some(1));
pub(crate) const CONTROL_PLANE_UNAVAILABLE: Fault =
    fault(503, "service_unavailable", "control_plane_unavailable", Some(1));

/// Every error the proxy answers with, by the name of the exception class the control plane
/// raises it as (`pdproxy/errors.py` reads each class's status, type and code from here). The
/// last two the edge alone answers with.
pub(crate) const ERRORS: [(&str, Fault); 34] = [
    ("PdproxyError", INTERNAL),
    ("ConfigError", INVALID_CONFIG),
    ("InvalidRequest", INVALID_REQUEST),
    ("RequestTooLarge", REQUEST_TOO_LARGE),
    ("RequestTimeout", REQUEST_TIMEOUT),
    ("UnsupportedMediaType", UNSUPPORTED_MEDIA_TYPE),
    ("NotFound", NOT_FOUND),
    ("MethodNotAllowed", METHOD_NOT_ALLOWED),
    ("CorsRefused", CORS_REFUSED),
    ("Unauthorized", UNAUTHORIZED),
    ("Forbidden", FORBIDDEN),
    ("Draining", DRAINING),
    ("InvalidNode", INVALID_NODE),
    ("NodeNotFound", NODE_NOT_FOUND),
    ("RegistryUnavailable", REGISTRY_UNAVAILABLE),
    ("DistServeOff", DISTSERVE_OFF),
    ("WorkerExists", WORKER_EXISTS),
    ("NoNodeAvailable", NO_HEALTHY_NODE),
    ("ModelNotFound", MODEL_NOT_FOUND),
    ("Overloaded", OVERLOADED),
    ("RateLimited", OVER_REQUEST_RATE),
    ("TokensRateLimited", OVER_TOKEN_RATE),
    ("QuotaExceeded", OVER_BUDGET),
    ("ProxyOverloaded", PROXY_OVERLOADED),
    ("LoopDetected", LOOP_DETECTED),
    ("UpstreamError", UPSTREAM_ERROR),
    ("UpstreamConnectError", UPSTREAM_CONNECT_FAILED),
    ("UpstreamTimeout", UPSTREAM_TIMEOUT),
    ("TerminateFailed", TERMINATE_FAILED),
    ("InvalidAnswer", UPSTREAM_INVALID_RESPONSE),
    ("PrefillFailed", PREFILL_FAILED),
    ("LinkFailed", PD_LINK_FAILED),
    ("TooManyConnections", TOO_MANY_CONNECTIONS),
    ("ControlPlaneUnavailable", CONTROL_PLANE_UNAVAILABLE),
];

/// The answer to a data-plane error (`py/errors.rs` raises the same as exception classes).
pub(crate) fn fault_of(error: &Error) -> Fault {
    match error.kind() {
        Kind::InvalidRequest => INVALID_REQUEST,
        Kind::InvalidNode | Kind::NodeUnresolvable => INVALID_NODE,
        Kind::NodeNotFound => NODE_NOT_FOUND,
        Kind::ModelNotFound => MODEL_NOT_FOUND,
        Kind::NoNodes | Kind::NoHealthyNode => NO_HEALTHY_NODE,
        Kind::Overloaded => OVERLOADED,
        Kind::Connect => UPSTREAM_CONNECT_FAILED,
        Kind::Timeout => UPSTREAM_TIMEOUT,
        Kind::Upstream | Kind::Cancelled => UPSTREAM_ERROR,
        Kind::InvalidAnswer => UPSTREAM_INVALID_RESPONSE,
        Kind::Resources => PROXY_OVERLOADED,
        Kind::Config => INVALID_CONFIG,
        Kind::LinkFailed => PD_LINK_FAILED,
    }
}

/// The answer to a tenant over one of its limits (as `errors.py`'s `RateLimited`).
pub(crate) fn limit_fault(limit: Limit) -> Fault {
    match limit {
        Limit::Requests | Limit::Concurrency => OVER_REQUEST_RATE,
        Limit::Tokens => OVER_TOKEN_RATE,
        Limit::Budget => OVER_BUDGET,
    }
}

/// The `OpenAI` error envelope: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Serialize)]
struct Envelope<'a> {
    error: ErrorFields<'a>,
}

#[derive(Serialize)]
struct ErrorFields<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: &'a str,
}

/// The error body of `fault`: `{"error": {"message", "type", "param", "code"}}`.
pub(crate) fn error_body(message: &str, fault: Fault, param: Option<&str>) -> String {
    envelope(message, fault.kind, fault.code, param)
}

/// The error body of any type and code (the control plane's answers come through here too).
pub(crate) fn envelope(message: &str, kind: &str, code: &str, param: Option<&str>) -> String {
    let fields = ErrorFields { message, kind, param, code };
    serde_json::to_string(&Envelope { error: fields }).unwrap_or_default()
}

/// The last event of a stream that failed after its head was sent: `OpenAI` clients raise on a
/// `data:` object with an `error` key.
pub(crate) fn stream_error_event(message: &str, fault: Fault) -> Bytes {
    let mut out = String::with_capacity(128 + message.len());
    out.push_str("data: ");
    out.push_str(&error_body(message, fault, None));
    out.push_str("\n\n");
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_are_the_openai_envelope() {
        let body = error_body("the model `m\u{e9}` does not exist\n", MODEL_NOT_FOUND, None);
        let parsed: serde_json::Value = serde_json::from_str(&body).unwrap();
        let expected = serde_json::json!({"error": {
            "message": "the model `m\u{e9}` does not exist\n",
            "type": "invalid_request_error",
            "param": null,
            "code": "model_not_found",
        }});
        assert_eq!(parsed, expected);
        assert!(body.starts_with(r#"{"error":{"message":"#), "the envelope's fields in OpenAI's order: {body}");
        let parsed: serde_json::Value = serde_json::from_str(&error_body("n", INVALID_REQUEST, Some("n"))).unwrap();
        assert_eq!(parsed["error"]["param"], "n");
    }
}
