//! The proxy's own error answers as responses: the envelope with `x-pdproxy-error`, and the
//! `x-request-id` echoed.

use bytes::Bytes;
use http::header::{HeaderValue, CONNECTION, CONTENT_TYPE, RETRY_AFTER, WWW_AUTHENTICATE};
use http::{Response, StatusCode};

use super::answer::{error_body, Fault, DRAINING, UNAUTHORIZED};
use super::body::EdgeBody;
use super::request::X_REQUEST_ID;

/// The error answer, with `x-request-id` echoed.
pub(crate) fn error(
    fault: Fault,
    message: &str,
    retry_after: Option<u32>,
    request_id: &HeaderValue,
) -> Response<EdgeBody> {
    error_about(fault, message, retry_after, None, request_id)
}

/// The error answer about the request's field `param`.
pub(crate) fn error_about(
    fault: Fault,
    message: &str,
    retry_after: Option<u32>,
    param: Option<&str>,
    request_id: &HeaderValue,
) -> Response<EdgeBody> {
    let mut response = Response::new(EdgeBody::full(Bytes::from(error_body(message, fault, param))));
    *response.status_mut() = StatusCode::from_u16(fault.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert("x-pdproxy-error", HeaderValue::from_static(fault.code));
    if let Some(seconds) = retry_after.or(fault.retry_after) {
        headers.insert(RETRY_AFTER, HeaderValue::from(seconds));
    }
    if fault == UNAUTHORIZED {
        headers.insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    if fault == DRAINING {
        headers.insert(CONNECTION, HeaderValue::from_static("close"));
    }
    headers.insert(X_REQUEST_ID.clone(), request_id.clone());
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::edge::answer::fault_of;
    use crate::error::{Error, Kind};

    /// The answer to a data-plane error.
    fn from_error(error: &Error, request_id: &HeaderValue) -> Response<EdgeBody> {
        error_about(fault_of(error), error.message(), error.retry_after(), error.param(), request_id)
    }

    #[test]
    fn headers_follow_the_fault() {
        let id = HeaderValue::from_static("abc");
        let r = error(DRAINING, "draining", None, &id);
        assert_eq!(r.status(), 503);
        assert_eq!(r.headers()["connection"], "close");
        assert_eq!(r.headers()["retry-after"], "1");
        assert_eq!(r.headers()["x-pdproxy-error"], "draining");
        assert_eq!(r.headers()["x-request-id"], "abc");
        let r = from_error(&Error::new(Kind::Overloaded, "full").with_retry_after(7), &id);
        assert_eq!((r.status().as_u16(), r.headers()["retry-after"].to_str().unwrap()), (429, "7"));
        assert!(error(UNAUTHORIZED, "no", None, &id).headers().contains_key("www-authenticate"));
    }
}
