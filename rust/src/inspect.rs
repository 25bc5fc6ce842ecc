//! Request-body inspection: the few fields routing needs, read straight from the bytes
//! without building a document tree.

use std::borrow::Cow;

use serde::Deserialize;

use crate::error::{Error, Kind, Result};

/// What the data plane needs to know about a request body.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RequestInfo {
    pub model: Option<String>,
    pub stream: bool,
}

#[derive(Deserialize)]
struct Fields<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(default)]
    stream: Option<bool>,
}

/// Reads `model` and `stream` from a JSON object body. Unknown fields are skipped unparsed.
pub fn inspect(body: &[u8]) -> Result<RequestInfo> {
    // serde would also accept a JSON array for a struct; a request body must be an object.
    match body.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'{') => {}
        Some(_) => return Err(Error::new(Kind::InvalidRequest, "request body must be a JSON object")),
        None => return Err(Error::new(Kind::InvalidRequest, "request body is empty")),
    }
    let fields: Fields<'_> = serde_json::from_slice(body)
        .map_err(|e| Error::new(Kind::InvalidRequest, format!("request body is not valid JSON: {e}")))?;
    Ok(RequestInfo { model: fields.model.map(Cow::into_owned), stream: fields.stream.unwrap_or(false) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_model_and_stream() {
        let info = inspect(br#"{"messages":[{"role":"user","content":"hi"}],"model":"m1","stream":true}"#).unwrap();
        assert_eq!(info, RequestInfo { model: Some("m1".into()), stream: true });
    }

    #[test]
    fn missing_fields_default() {
        assert_eq!(inspect(b" {} ").unwrap(), RequestInfo::default());
        assert_eq!(inspect(br#"{"model":null,"stream":null}"#).unwrap(), RequestInfo::default());
    }

    #[test]
    fn escaped_model_name_is_decoded() {
        assert_eq!(inspect(br#"{"model":"a\/b"}"#).unwrap().model.as_deref(), Some("a/b"));
    }

    #[test]
    fn rejects_bad_bodies() {
        for body in [&b""[..], b"[]", b"not json", br#"{"model":1}"#, br#"{"stream":"yes"}"#, br#"{"model":"m""#] {
            let err = inspect(body).unwrap_err();
            assert_eq!(err.kind(), Kind::InvalidRequest, "{:?}", String::from_utf8_lossy(body));
        }
    }
}
