//! Request bodies: the fields routing needs, read straight from the bytes without building
//! a document tree; and top-level patching for the adapters that rewrite requests.

use std::borrow::Cow;

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::error::{Error, Kind, Result};

/// What the data plane needs to know about a request body.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct RequestInfo<'a> {
    pub(crate) model: Option<Cow<'a, str>>,
    pub(crate) stream: bool,
    pub(crate) n: Option<u64>,
    pub(crate) best_of: Option<u64>,
    pub(crate) user: Option<Cow<'a, str>>,
    /// `session_id`, as LMDeploy accepts it (a string or an integer).
    pub(crate) session_id: Option<Cow<'a, str>>,
    pub(crate) max_tokens: Option<u64>,
    /// The raw JSON of `messages` (chat) or `prompt` (completions), for cache-aware routing.
    pub(crate) prompt: Option<&'a [u8]>,
    /// vLLM's `priority` (smaller is served first), for the wait queue.
    pub(crate) priority: Option<i32>,
}

impl RequestInfo<'_> {
    /// The affinity key: `session_id`, else `user`.
    pub(crate) fn body_affinity(&self) -> Option<&str> {
        self.session_id.as_deref().or(self.user.as_deref())
    }
}

#[derive(Deserialize)]
struct Fields<'a> {
    #[serde(borrow, default, deserialize_with = "borrowed_str")]
    model: Option<Cow<'a, str>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    n: Option<u64>,
    #[serde(default)]
    best_of: Option<u64>,
    #[serde(borrow, default, deserialize_with = "borrowed_str")]
    user: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    session_id: Option<&'a RawValue>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(borrow, default)]
    messages: Option<&'a RawValue>,
    #[serde(borrow, default)]
    prompt: Option<&'a RawValue>,
    #[serde(default)]
    priority: Option<i32>,
}

/// An optional string that borrows from the body unless it has escapes. serde's `borrow` reaches
/// a `Cow` only as a field of its own (not inside an `Option`, not parsed alone): there it copied
/// every model name.
fn borrowed_str<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<Cow<'de, str>>, D::Error> {
    struct OptionalStr;
    impl<'de> Visitor<'de> for OptionalStr {
        type Value = Option<Cow<'de, str>>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a string or null")
        }
        fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
            Ok(Some(Cow::Borrowed(v)))
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
            Ok(Some(Cow::Owned(v.to_owned())))
        }
        fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
            Ok(Some(Cow::Owned(v)))
        }
        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
            deserializer.deserialize_str(self)
        }
    }
    deserializer.deserialize_option(OptionalStr)
}

fn require_object(body: &[u8]) -> Result<()> {
    // serde would also accept a JSON array for a struct; a request body must be an object.
    match body.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'{') => Ok(()),
        Some(_) => Err(match serde_json::from_slice::<de::IgnoredAny>(body) {
            Ok(_) => Error::new(Kind::InvalidRequest, "request body must be a JSON object"),
            Err(e) => invalid(&e),
        }),
        None => Err(Error::new(Kind::InvalidRequest, "request body is empty: a JSON object is expected")),
    }
}

fn invalid(e: &serde_json::Error) -> Error {
    Error::new(Kind::InvalidRequest, format!("request body is not valid JSON: {e}"))
}

/// What each routing field of `Fields` must hold, as a client reads it. Only for naming the
/// field at fault once a body failed to read; which value is wrong is `Fields`' own judgement.
const EXPECTED: [(&str, &str); 7] = [
    ("model", "a string"),
    ("user", "a string"),
    ("stream", "true or false"),
    ("n", "a non-negative integer"),
    ("best_of", "a non-negative integer"),
    ("max_tokens", "a non-negative integer"),
    ("priority", "an integer (-2147483648 to 2147483647)"),
];

/// Whether `Fields` reads `raw` as the value of `key` (an object of that one member).
fn reads_as_field(key: &str, raw: &str) -> bool {
    let member = format!("{{{}:{raw}}}", serde_json::to_string(key).unwrap_or_default());
    serde_json::from_str::<Fields<'_>>(&member).is_ok()
}

/// What a JSON value is, by its first character, as a client would name it.
fn kind_of(raw: &str) -> &'static str {
    match raw.as_bytes().first() {
        Some(b'"') => "a string",
        Some(b'{') => "an object",
        Some(b'[') => "an array",
        Some(b't' | b'f') => "a boolean",
        Some(_) if raw.contains(['.', 'e', 'E']) => "a number",
        Some(_) => "the integer",
        None => "nothing",
    }
}

/// Why a body that is JSON could not be read, naming its field (the error body's `param`) when
/// one is at fault: a value of the wrong type, or a field given twice. The cold path only.
fn field_error(text: &str, e: &serde_json::Error) -> Error {
    let Ok(members) = serde_json::from_str::<Members<'_>>(text) else { return invalid(e) };
    for (i, (key, raw)) in members.0.iter().enumerate() {
        let Some(&(name, expected)) = EXPECTED.iter().find(|(name, _)| *name == key.as_ref()) else { continue };
        let raw = raw.get();
        if !reads_as_field(name, raw) {
            let shown: String = raw.chars().take(40).collect();
            let more = if shown.len() < raw.len() { "..." } else { "" };
            let message = format!("{name} must be {expected}, got {} {shown}{more}", kind_of(raw));
            return Error::new(Kind::InvalidRequest, message).with_param(name);
        }
        if members.0[..i].iter().any(|(earlier, _)| earlier == key) {
            return Error::new(Kind::InvalidRequest, format!("{name} is given twice in the request body"))
                .with_param(name);
        }
    }
    Error::new(Kind::InvalidRequest, format!("request body could not be read: {e}"))
}

/// Reads the routing fields of a JSON object body. Other fields are skipped unparsed.
pub(crate) fn inspect(body: &[u8]) -> Result<RequestInfo<'_>> {
    require_object(body)?;
    // UTF-8 checked once for the whole body: parsing bytes would check each string again.
    let text = std::str::from_utf8(body)
        .map_err(|e| Error::new(Kind::InvalidRequest, format!("request body is not valid UTF-8: {e}")))?;
    let fields: Fields<'_> = serde_json::from_str(text).map_err(|e| match e.classify() {
        serde_json::error::Category::Data => field_error(text, &e),
        _ => invalid(&e),
    })?;
    let session_id = match fields.session_id {
        None => None,
        Some(raw) => {
            let text = raw.get();
            if text.starts_with('"') {
                borrowed_str(&mut serde_json::Deserializer::from_str(text)).map_err(|e| invalid(&e))?
            } else if text.parse::<i64>().is_ok() {
                Some(Cow::Borrowed(text))
            } else if text == "null" {
                None
            } else {
                let message = "session_id must be a string or an integer";
                return Err(Error::new(Kind::InvalidRequest, message).with_param("session_id"));
            }
        }
    };
    Ok(RequestInfo {
        model: fields.model,
        stream: fields.stream.unwrap_or(false),
        n: fields.n,
        best_of: fields.best_of,
        user: fields.user,
        session_id,
        max_tokens: fields.max_tokens,
        prompt: fields.messages.or(fields.prompt).map(|raw| raw.get().as_bytes()),
        priority: fields.priority,
    })
}

/// The top-level members of a JSON object, in order, values kept as raw JSON.
struct Members<'a>(Vec<(Cow<'a, str>, &'a RawValue)>);

impl<'de> Deserialize<'de> for Members<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct MembersVisitor;
        impl<'de> Visitor<'de> for MembersVisitor {
            type Value = Members<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut members = Vec::with_capacity(map.size_hint().unwrap_or(8));
                while let Some((key, value)) = map.next_entry::<Cow<'de, str>, &'de RawValue>()? {
                    members.push((key, value));
                }
                Ok(Members(members))
            }
        }
        deserializer.deserialize_map(MembersVisitor).map_err(de::Error::custom)
    }
}

/// The raw JSON text of one top-level member, exactly as it appears in `body`.
pub(crate) fn member<'a>(body: &'a [u8], key: &str) -> Result<Option<&'a str>> {
    require_object(body)?;
    let members: Members<'_> = serde_json::from_slice(body).map_err(|e| invalid(&e))?;
    Ok(members.0.into_iter().find(|(k, _)| k == key).map(|(_, v)| v.get()))
}

/// Rewrites a JSON object body: every `(key, json)` in `set` replaces or appends that member
/// (its value given as JSON text), every key in `remove` is dropped. Other members keep their
/// order and their exact bytes.
pub(crate) fn patch(body: &[u8], set: &[(&str, &str)], remove: &[&str]) -> Result<Vec<u8>> {
    require_object(body)?;
    let members: Members<'_> = serde_json::from_slice(body).map_err(|e| invalid(&e))?;
    let mut values: Vec<(Cow<'_, str>, Cow<'_, str>)> = Vec::with_capacity(members.0.len() + set.len());
    for (key, value) in members.0 {
        if remove.contains(&key.as_ref()) || values.iter().any(|(k, _)| *k == key) {
            continue;
        }
        values.push((key, Cow::Borrowed(value.get())));
    }
    for (key, json) in set {
        let checked: &RawValue = serde_json::from_str(json)
            .map_err(|e| Error::new(Kind::InvalidRequest, format!("patch value for {key:?} is not JSON: {e}")))?;
        let text = checked.get().to_owned();
        match values.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = Cow::Owned(text),
            None => values.push((Cow::Owned((*key).to_owned()), Cow::Owned(text))),
        }
    }
    let mut out = String::with_capacity(body.len() + 64);
    out.push('{');
    for (i, (key, value)) in values.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        push_key(&mut out, key);
        out.push(':');
        out.push_str(value);
    }
    out.push('}');
    Ok(out.into_bytes())
}

/// A member's key as JSON: as it is when nothing in it needs escaping (almost always), else
/// re-encoded, so that any escaping in the original stays valid.
fn push_key(out: &mut String, key: &str) {
    if key.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
        out.push('"');
        out.push_str(key);
        out.push('"');
    } else {
        out.push_str(&serde_json::to_string(key).unwrap_or_default());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_routing_fields() {
        let body = br#"{"messages":[{"role":"user","content":"hi"}],"model":"m1","stream":true,"n":2,"user":"u","max_tokens":5}"#;
        let info = inspect(body).unwrap();
        assert_eq!(info.model.as_deref(), Some("m1"));
        assert!(info.stream);
        assert_eq!((info.n, info.max_tokens), (Some(2), Some(5)));
        assert_eq!(info.body_affinity(), Some("u"));
        assert_eq!(info.prompt, Some(&br#"[{"role":"user","content":"hi"}]"#[..]));
    }

    #[test]
    fn session_id_may_be_a_number() {
        assert_eq!(inspect(br#"{"session_id": 42, "user": "u"}"#).unwrap().body_affinity(), Some("42"));
        assert_eq!(inspect(br#"{"session_id": "s-1"}"#).unwrap().body_affinity(), Some("s-1"));
        assert!(inspect(br#"{"session_id": [1]}"#).is_err());
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
    fn plain_names_are_borrowed_from_the_body() {
        let info = inspect(br#"{"model":"m1","user":"u"}"#).unwrap();
        assert!(matches!(info.model, Some(Cow::Borrowed("m1"))), "{:?}", info.model);
        assert!(matches!(info.user, Some(Cow::Borrowed("u"))), "{:?}", info.user);
        assert!(matches!(inspect(br#"{"model":"a\/b"}"#).unwrap().model, Some(Cow::Owned(_))));
        let info = inspect(br#"{"session_id":"s-1"}"#).unwrap();
        assert!(matches!(info.session_id, Some(Cow::Borrowed("s-1"))), "{:?}", info.session_id);
        let info = inspect(br#"{"session_id":"s\u002d1"}"#).unwrap();
        assert_eq!(info.session_id.as_deref(), Some("s-1"), "escapes decoded");
    }

    #[test]
    fn rejects_bad_bodies() {
        for body in [
            &b""[..],
            b"[]",
            b"not json",
            br#"{"model":1}"#,
            br#"{"stream":"yes"}"#,
            br#"{"model":"m""#,
            br#"{"n":-1}"#,
            b"{\"model\":\"\xff\"}",
        ] {
            let err = inspect(body).unwrap_err();
            assert_eq!(err.kind(), Kind::InvalidRequest, "{:?}", String::from_utf8_lossy(body));
        }
    }

    #[test]
    fn a_field_of_the_wrong_type_is_named() {
        for (body, param, message) in [
            (&br#"{"model": 5}"#[..], "model", "model must be a string, got the integer 5"),
            (br#"{"model":"m","stream":"yes"}"#, "stream", "stream must be true or false, got a string \"yes\""),
            (br#"{"n":-1}"#, "n", "n must be a non-negative integer, got the integer -1"),
            (br#"{"max_tokens":1.5}"#, "max_tokens", "max_tokens must be a non-negative integer, got a number 1.5"),
            (
                br#"{"priority":[1]}"#,
                "priority",
                "priority must be an integer (-2147483648 to 2147483647), got an array [1]",
            ),
            (br#"{"session_id":{}}"#, "session_id", "session_id must be a string or an integer"),
            (br#"{"model":"a","model":"b"}"#, "model", "model is given twice in the request body"),
        ] {
            let err = inspect(body).unwrap_err();
            assert_eq!(err.param(), Some(param), "{:?}", String::from_utf8_lossy(body));
            assert_eq!(err.message(), message);
        }
        let long = format!(r#"{{"model": [{}]}}"#, "1,".repeat(100) + "1");
        assert!(inspect(long.as_bytes()).unwrap_err().message().ends_with("1,1,1...",), "a long value is cut short");
    }

    #[test]
    fn a_body_that_is_not_json_says_so() {
        for body in [&b"not json"[..], br#"{"model":"m""#, br#"{"model":"m",}"#] {
            let err = inspect(body).unwrap_err();
            assert!(err.message().starts_with("request body is not valid JSON: "), "{}", err.message());
            assert_eq!(err.param(), None);
        }
    }

    #[test]
    fn member_is_the_raw_text() {
        let body = br#"{"a":1,"kv":{"x": [1, 2] ,"y":null}}"#;
        assert_eq!(member(body, "kv").unwrap(), Some(r#"{"x": [1, 2] ,"y":null}"#));
        assert_eq!(member(body, "b").unwrap(), None);
    }

    #[test]
    fn patch_sets_replaces_and_removes_keeping_the_rest() {
        let body = br#"{"model":"m","stream":true,"messages":[{"content":"h\u00e9"}],"max_tokens":100}"#;
        let out =
            patch(body, &[("max_tokens", "1"), ("stream", "false"), ("with_cache", "true")], &["messages"]).unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), r#"{"model":"m","stream":false,"max_tokens":1,"with_cache":true}"#);
        assert!(patch(body, &[("x", "not json")], &[]).is_err());
        assert!(patch(b"[1]", &[], &[]).is_err());
    }

    #[test]
    fn patch_keeps_keys_that_need_escaping_valid() {
        let body = br#"{"a\"b":1,"tab\there":2,"caf\u00e9":3}"#;
        let out = patch(body, &[("n", "1")], &[]).unwrap();
        let parsed: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(parsed, serde_json::json!({"a\"b": 1, "tab\there": 2, "caf\u{e9}": 3, "n": 1}));
    }
}
