//! The two texts the KV index compares: the engine's blocks, from their token ids
//! (`Detokenizer`), and the request's prompt as the engine renders it (`ChatTemplate`).
//!
//! Matching on text instead of tokens keeps tokenizing off the request path: an engine's
//! block ids give its text back exactly (byte-level vocabularies decode each id to fixed
//! bytes), and a prompt that begins with a block chain's text was tokenized into those blocks
//! (a tokenizer cuts a text the same way whatever follows, but for the last token or two, which
//! only the last, partial block holds).

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;

/// Token ids to the bytes they stand for.
#[derive(Debug, Clone)]
pub(crate) enum Detokenizer {
    /// Each id's bytes (a vocabulary read from the model's `tokenizer.json`); ids whose text
    /// the prompt does not carry (a beginning-of-sequence token the tokenizer adds) map to none.
    Table(Vec<Box<[u8]>>),
    /// Each id is its text's `n` bytes, little-endian (the mock engine's tokenizer).
    FixedWidth(usize),
}

impl Detokenizer {
    /// Appends the text of `ids` to `out`; false (and `out` left part written) when an id is
    /// not in the vocabulary.
    pub(crate) fn append(&self, ids: &[u64], out: &mut Vec<u8>) -> bool {
        match self {
            Self::Table(table) => {
                for &id in ids {
                    let Some(text) = usize::try_from(id).ok().and_then(|i| table.get(i)) else { return false };
                    out.extend_from_slice(text);
                }
            }
            Self::FixedWidth(width) => {
                for &id in ids {
                    out.extend_from_slice(&id.to_le_bytes()[..(*width).min(8)]);
                }
            }
        }
        true
    }
}

/// How the engine renders chat messages into its prompt, when each message renders the same
/// wherever it stands: `start`, then for each message `before_role` role `after_role` content
/// `end`, then `generation` (the assistant's turn opened). Templates that do more (a default
/// system prompt, trimming, tools) are not of this shape; their nodes are matched by the
/// approximate table instead.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ChatTemplate {
    pub(crate) start: Vec<u8>,
    pub(crate) before_role: Vec<u8>,
    pub(crate) after_role: Vec<u8>,
    pub(crate) end: Vec<u8>,
    pub(crate) generation: Vec<u8>,
}

impl ChatTemplate {
    /// The mock engine's (`pdproxy.testing.tokens.render_prompt`).
    #[cfg(test)]
    pub(crate) fn mock() -> Self {
        Self {
            start: Vec::new(),
            before_role: b"<|".to_vec(),
            after_role: b"|>".to_vec(),
            end: b"<|end|>".to_vec(),
            generation: b"<|assistant|>".to_vec(),
        }
    }
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow, default)]
    role: Option<Cow<'a, str>>,
    /// A string, or a list of parts (kept raw: which it is shows in its first byte).
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Part<'a> {
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
}

/// Appends a message's content: its text, or its parts' texts one after the other.
fn append_content(content: &RawValue, out: &mut Vec<u8>) -> Option<()> {
    let raw = content.get();
    match raw.as_bytes().first()? {
        b'"' => out.extend_from_slice(serde_json::from_str::<Cow<'_, str>>(raw).ok()?.as_bytes()),
        b'[' => {
            for part in serde_json::from_str::<Vec<Part<'_>>>(raw).ok()? {
                out.extend_from_slice(part.text.as_deref().unwrap_or_default().as_bytes());
            }
        }
        b'n' => {} // null: an assistant turn of tool calls
        _ => return None,
    }
    Some(())
}

/// The prompt the engine computes, from the request's `messages` or `prompt` (raw JSON):
/// messages through `template`, a prompt string as it is. `None`: not text this can render
/// (token ids, several prompts, malformed).
pub(crate) fn render(raw: &[u8], template: &ChatTemplate) -> Option<Vec<u8>> {
    match raw.trim_ascii_start().first()? {
        b'"' => {
            let text: Cow<'_, str> = serde_json::from_slice(raw).ok()?;
            Some(text.into_owned().into_bytes())
        }
        b'[' => {
            let messages: Vec<Message<'_>> = serde_json::from_slice(raw).ok()?;
            let mut out = Vec::with_capacity(raw.len() + 16 * messages.len());
            out.extend_from_slice(&template.start);
            for message in &messages {
                out.extend_from_slice(&template.before_role);
                out.extend_from_slice(message.role.as_deref().unwrap_or("user").as_bytes());
                out.extend_from_slice(&template.after_role);
                if let Some(content) = message.content {
                    append_content(content, &mut out)?;
                }
                out.extend_from_slice(&template.end);
            }
            out.extend_from_slice(&template.generation);
            Some(out)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_render_as_the_mock_engine_renders_them() {
        let raw = br#"[{"role":"system","content":"Be \"brief\"."},{"role":"user","content":[{"type":"text","text":"hi "},{"type":"text","text":"there"}]},{"role":"assistant","content":null}]"#;
        let text = render(raw, &ChatTemplate::mock()).unwrap();
        assert_eq!(
            String::from_utf8(text).unwrap(),
            "<|system|>Be \"brief\".<|end|><|user|>hi there<|end|><|assistant|><|end|><|assistant|>"
        );
    }

    #[test]
    fn a_prompt_string_is_its_text_and_token_ids_are_not_rendered() {
        assert_eq!(render(br#""caf\u00e9""#, &ChatTemplate::mock()).unwrap(), "café".as_bytes());
        assert_eq!(render(b"[1, 2, 3]", &ChatTemplate::mock()), None);
        assert_eq!(render(b"{\"a\":1}", &ChatTemplate::mock()), None);
        assert_eq!(render(b"[{\"role\":", &ChatTemplate::mock()), None);
    }

    #[test]
    fn ids_give_their_text_back() {
        let mut out = Vec::new();
        assert!(Detokenizer::FixedWidth(4).append(&[u64::from(u32::from_le_bytes(*b"abcd"))], &mut out));
        assert_eq!(out, b"abcd");
        let table = Detokenizer::Table(vec![Box::from(&b""[..]), Box::from(&b"he"[..]), Box::from(&b"llo"[..])]);
        out.clear();
        assert!(table.append(&[0, 1, 2], &mut out));
        assert_eq!(out, b"hello");
        assert!(!table.append(&[7], &mut out), "an id past the vocabulary");
    }
}
