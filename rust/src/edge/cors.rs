//! CORS, the one implementation: the inference routes' answers carry the origin's permission,
//! and their preflights are answered here. The edge applies it to what it serves; the control
//! plane's app to what it serves (`GET /v1/models`, and everything under `--edge granian`),
//! through the extension's `Pipeline`.

use http::header::{
    HeaderMap, HeaderValue, ACCESS_CONTROL_ALLOW_CREDENTIALS, ACCESS_CONTROL_ALLOW_HEADERS,
    ACCESS_CONTROL_ALLOW_METHODS, ACCESS_CONTROL_ALLOW_ORIGIN, ACCESS_CONTROL_MAX_AGE, ACCESS_CONTROL_REQUEST_HEADERS,
    ACCESS_CONTROL_REQUEST_METHOD, ORIGIN, VARY,
};
use http::{Method, Response, StatusCode};

use super::answer::Fault;
use super::body::EdgeBody;
use super::error_answer;
use super::INFERENCE_PATHS;

/// What `*` means in the allowed methods (Starlette's list, as LMDeploy's `api_server` uses).
const ALL_METHODS: [&str; 7] = ["DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT"];
/// Headers browsers may always send (the CORS safelist).
const SAFELISTED: [&str; 4] = ["accept", "accept-language", "content-language", "content-type"];
/// Seconds a browser may cache a preflight's answer.
const MAX_AGE: HeaderValue = HeaderValue::from_static("600");
const CORS_REFUSED: Fault =
    Fault { status: 400, kind: "invalid_request_error", code: "cors_refused", retry_after: None };

/// The settings' CORS rules (`--allow-origins`, `--allow-credentials`, `--allow-methods`,
/// `--allow-headers`); `None` in the edge's config when no origin is allowed.
#[derive(Debug, Clone)]
pub(crate) struct Cors {
    any_origin: bool,
    origins: Vec<String>,
    credentials: bool,
    methods: Vec<String>,
    allowed_methods: HeaderValue,
    any_header: bool,
    headers: Vec<String>,
}

impl Cors {
    pub(crate) fn new(origins: &[String], credentials: bool, methods: &[String], headers: &[String]) -> Option<Self> {
        if origins.is_empty() {
            return None;
        }
        let methods: Vec<String> = if methods.iter().any(|m| m == "*") {
            ALL_METHODS.iter().map(|&m| m.to_owned()).collect()
        } else {
            methods.iter().map(|m| m.to_ascii_uppercase()).collect()
        };
        let allowed_methods = HeaderValue::from_str(&methods.join(", ")).ok()?;
        let mut names: Vec<String> = SAFELISTED.iter().map(|&h| h.to_owned()).collect();
        names.extend(headers.iter().map(|h| h.to_ascii_lowercase()));
        Some(Self {
            any_origin: origins.iter().any(|o| o == "*"),
            origins: origins.to_vec(),
            credentials,
            methods,
            allowed_methods,
            any_header: headers.iter().any(|h| h == "*"),
            headers: names,
        })
    }

    /// Whether browsers may call `path` (the `OpenAI` API and the other inference routes).
    pub(crate) fn applies_to(path: &str) -> bool {
        path.starts_with("/v1/") || INFERENCE_PATHS.contains(&path)
    }

    /// Whether a request is a preflight (an `OPTIONS` that names the method to come).
    pub(crate) fn is_preflight(method: &Method, headers: &HeaderMap) -> bool {
        method == Method::OPTIONS && headers.contains_key(ORIGIN) && headers.contains_key(ACCESS_CONTROL_REQUEST_METHOD)
    }

    fn allows(&self, origin: &HeaderValue) -> bool {
        self.any_origin || origin.to_str().is_ok_and(|o| self.origins.iter().any(|allowed| allowed == o))
    }

    fn add_origin(&self, headers: &mut HeaderMap, origin: &HeaderValue) {
        if self.any_origin && !self.credentials {
            headers.insert(ACCESS_CONTROL_ALLOW_ORIGIN, HeaderValue::from_static("*"));
            return;
        }
        headers.insert(ACCESS_CONTROL_ALLOW_ORIGIN, origin.clone());
        headers.append(VARY, HeaderValue::from_static("Origin"));
        if self.credentials {
            headers.insert(ACCESS_CONTROL_ALLOW_CREDENTIALS, HeaderValue::from_static("true"));
        }
    }

    /// Adds to an actual (not preflight) answer's headers the permission of `origin`, when it
    /// has one.
    pub(crate) fn decorate(&self, headers: &mut HeaderMap, origin: &HeaderValue) {
        if self.allows(origin) {
            self.add_origin(headers, origin);
        }
    }

    /// The answer to a preflight: 204 with what is allowed, or 400 `cors_refused`.
    pub(crate) fn preflight(&self, headers: &HeaderMap, request_id: &HeaderValue) -> Response<EdgeBody> {
        let refuse = |why: &str| error_answer::error(CORS_REFUSED, why, None, request_id);
        let Some(origin) = headers.get(ORIGIN) else { return refuse("a preflight names its origin") };
        if !self.allows(origin) {
            return refuse("this origin may not call the proxy from a browser (see --allow-origins)");
        }
        let method = headers.get(ACCESS_CONTROL_REQUEST_METHOD).and_then(|m| m.to_str().ok()).unwrap_or_default();
        if !self.methods.iter().any(|m| m.eq_ignore_ascii_case(method)) {
            return refuse("this method may not be used from a browser (see --allow-methods)");
        }
        let requested: Vec<String> = headers
            .get(ACCESS_CONTROL_REQUEST_HEADERS)
            .and_then(|h| h.to_str().ok())
            .unwrap_or_default()
            .split(',')
            .map(|h| h.trim().to_ascii_lowercase())
            .filter(|h| !h.is_empty())
            .collect();
        if !self.any_header && requested.iter().any(|h| !self.headers.contains(h)) {
            return refuse("a requested header may not be sent from a browser (see --allow-headers)");
        }
        let mut response = Response::new(EdgeBody::empty());
        *response.status_mut() = StatusCode::NO_CONTENT;
        let out = response.headers_mut();
        self.add_origin(out, origin);
        out.insert(ACCESS_CONTROL_ALLOW_METHODS, self.allowed_methods.clone());
        if let Ok(names) = HeaderValue::from_str(&requested.join(", ")) {
            if !requested.is_empty() {
                out.insert(ACCESS_CONTROL_ALLOW_HEADERS, names);
            }
        }
        out.insert(ACCESS_CONTROL_MAX_AGE, MAX_AGE);
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(items: &[&str]) -> Vec<String> {
        items.iter().map(|&s| s.to_owned()).collect()
    }

    fn preflight(cors: &Cors, origin: &str, method: &str, requested: &str) -> Response<EdgeBody> {
        let mut h = HeaderMap::new();
        h.insert(ORIGIN, origin.parse().unwrap());
        h.insert(ACCESS_CONTROL_REQUEST_METHOD, method.parse().unwrap());
        h.insert(ACCESS_CONTROL_REQUEST_HEADERS, requested.parse().unwrap());
        cors.preflight(&h, &HeaderValue::from_static("id"))
    }

    #[test]
    fn any_origin_without_credentials_is_a_star() {
        let cors = Cors::new(&strings(&["*"]), false, &strings(&["*"]), &strings(&["*"])).unwrap();
        let ok = preflight(&cors, "https://app.example", "POST", "Content-Type, X-Custom");
        assert_eq!(ok.status(), StatusCode::NO_CONTENT);
        assert_eq!(ok.headers()[ACCESS_CONTROL_ALLOW_ORIGIN], "*");
        assert_eq!(ok.headers()[ACCESS_CONTROL_ALLOW_HEADERS], "content-type, x-custom");
        assert_eq!(ok.headers()[ACCESS_CONTROL_ALLOW_METHODS], "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT");
        assert!(!ok.headers().contains_key(VARY));
    }

    #[test]
    fn named_origins_are_echoed_with_credentials_and_others_refused() {
        let cors = Cors::new(&strings(&["https://a.example"]), true, &strings(&["POST"]), &strings(&["x-session-id"]))
            .unwrap();
        let ok = preflight(&cors, "https://a.example", "post", "content-type, x-session-id");
        assert_eq!(ok.headers()[ACCESS_CONTROL_ALLOW_ORIGIN], "https://a.example");
        assert_eq!(ok.headers()[ACCESS_CONTROL_ALLOW_CREDENTIALS], "true");
        assert_eq!(ok.headers()[VARY], "Origin");
        for (origin, method, requested) in [
            ("https://b.example", "POST", ""),
            ("https://a.example", "DELETE", ""),
            ("https://a.example", "POST", "x-other"),
        ] {
            let refused = preflight(&cors, origin, method, requested);
            assert_eq!(refused.status(), StatusCode::BAD_REQUEST, "{origin} {method} {requested}");
            assert!(!refused.headers().contains_key(ACCESS_CONTROL_ALLOW_ORIGIN));
        }
        assert!(Cors::new(&[], false, &strings(&["*"]), &strings(&["*"])).is_none(), "no origin: CORS is off");
    }
}
