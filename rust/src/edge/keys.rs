//! API keys of the inference routes, compared in constant time: every key is compared in full
//! whatever the outcome, so the time taken does not tell how much of a guess was right. A key
//! comes as `Authorization: Bearer KEY` (the `OpenAI` clients) or `x-api-key: KEY` (Anthropic's).

use http::header::{HeaderName, AUTHORIZATION};
use http::HeaderMap;

/// What a request without a valid key is told.
pub(crate) const KEY_REQUIRED: &str = "a valid API key is required (Authorization: Bearer KEY, or x-api-key: KEY)";

/// Anthropic's clients send their key in this header.
pub(crate) static X_API_KEY: HeaderName = HeaderName::from_static("x-api-key");

#[derive(Debug, Default)]
pub(crate) struct Keys(Vec<Vec<u8>>);

impl Keys {
    pub(crate) fn new(keys: &[String]) -> Self {
        Self(keys.iter().map(|k| k.as_bytes().to_vec()).collect())
    }

    /// Whether any key is set.
    pub(crate) fn configured(&self) -> bool {
        !self.0.is_empty()
    }

    /// Whether the request may pass: no keys configured, or a client key that is one of them.
    pub(crate) fn allows(&self, headers: &HeaderMap) -> bool {
        if self.0.is_empty() {
            return true;
        }
        let Some(token) = client_key(headers) else { return false };
        self.0.iter().fold(false, |found, key| found | equal(token, key))
    }
}

/// The client's key: the token of the first `Authorization` header when its scheme is
/// `Bearer`, else the first `x-api-key`.
pub(crate) fn client_key(headers: &HeaderMap) -> Option<&[u8]> {
    match headers.get(AUTHORIZATION) {
        Some(value) => {
            let value = value.as_bytes();
            let (scheme, token) = value.split_at(value.iter().position(|&b| b == b' ')?);
            scheme.eq_ignore_ascii_case(b"bearer").then(|| token.trim_ascii())
        }
        None => headers.get(&X_API_KEY).map(|v| v.as_bytes().trim_ascii()),
    }
}

/// Constant-time equality (for a given key length).
fn equal(a: &[u8], b: &[u8]) -> bool {
    let mut diff = u8::from(a.len() != b.len());
    for (i, &kb) in b.iter().enumerate() {
        diff |= kb ^ a.get(i).copied().unwrap_or(!kb);
    }
    diff == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(auth: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(AUTHORIZATION, auth.parse().unwrap());
        h
    }

    #[test]
    fn only_whole_keys_pass() {
        let keys = Keys::new(&["secret".into(), "other".into()]);
        assert!(keys.allows(&headers("Bearer secret")));
        assert!(keys.allows(&headers("bearer  other ")));
        for wrong in ["Bearer s", "Bearer secret2", "Bearer secre", "Basic secret", "secret", "Bearer "] {
            assert!(!keys.allows(&headers(wrong)), "{wrong}");
        }
        assert!(!keys.allows(&HeaderMap::new()));
        assert!(Keys::default().allows(&HeaderMap::new()));
        let mut anthropic = HeaderMap::new();
        anthropic.insert(&X_API_KEY, "other".parse().unwrap());
        assert!(keys.allows(&anthropic));
        anthropic.insert(&X_API_KEY, "othe".parse().unwrap());
        assert!(!keys.allows(&anthropic));
    }
}
