//! A request's token count from its answer: the node's `usage` (`OpenAI`'s prompt and
//! completion tokens, or Anthropic's input and output tokens), found in the body or in a
//! streamed event (`stream_options.include_usage`); else estimated from what was sent.

use std::sync::LazyLock;

use memchr::memmem::Finder;
use serde::Deserialize;

/// Built once: a finder's setup costs more than a search of one event.
static USAGE: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"usage\""));

/// The tokens a node reported.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub(crate) struct Usage {
    #[serde(default, alias = "input_tokens")]
    pub(crate) prompt_tokens: u64,
    #[serde(default, alias = "output_tokens")]
    pub(crate) completion_tokens: u64,
}

/// Watches an answer's bytes for its `usage`.
#[derive(Debug, Default)]
pub(crate) struct UsageMeter {
    reported: Option<Usage>,
    events: u64,
    bytes: u64,
    /// A report cut by the end of a piece: its start, read again with the next piece.
    cut: Vec<u8>,
}

/// The longest report kept across pieces.
const MAX_CUT: usize = 4096;

impl UsageMeter {
    /// A piece of the answer as the client gets it, and the events it ended (counted by the
    /// caller, who counts them anyway).
    pub(crate) fn observe(&mut self, chunk: &[u8], events: u64) {
        self.bytes += chunk.len() as u64;
        self.events += events;
        if !self.cut.is_empty() {
            let mut cut = std::mem::take(&mut self.cut);
            cut.extend_from_slice(&chunk[..chunk.len().min(MAX_CUT)]);
            if let Found::Report(usage) = usage_at(&cut) {
                self.reported = Some(usage);
            }
        }
        for at in USAGE.find_iter(chunk) {
            match usage_at(&chunk[at + 7..]) {
                Found::Report(usage) => self.reported = Some(usage),
                Found::Cut if chunk.len() - at - 7 <= MAX_CUT => self.cut = chunk[at + 7..].to_vec(),
                Found::Cut | Found::Nothing => {}
            }
        }
    }

    /// Prompt and completion tokens, and whether they were estimated: without a report, the
    /// prompt as admission estimated it, and a completion token per streamed event (less the
    /// final `[DONE]`) or per four bytes of a whole answer.
    pub(crate) fn tokens(&self, prompt_estimate: u64) -> (u64, u64, bool) {
        match self.reported {
            Some(usage) => (usage.prompt_tokens, usage.completion_tokens, false),
            None if self.events > 0 => (prompt_estimate, self.events.saturating_sub(1), true),
            None => (prompt_estimate, self.bytes / 4, true),
        }
    }
}

enum Found {
    Report(Usage),
    /// The piece ended inside the report.
    Cut,
    Nothing,
}

/// The usage object after a `"usage"` key: `: {...}` (a `null` is no report).
fn usage_at(rest: &[u8]) -> Found {
    let value = rest.trim_ascii_start();
    let Some(value) = value.strip_prefix(b":").map(<[u8]>::trim_ascii_start) else {
        return if value.is_empty() { Found::Cut } else { Found::Nothing };
    };
    if value.is_empty() {
        return Found::Cut;
    }
    if !value.starts_with(b"{") {
        return Found::Nothing;
    }
    match serde_json::Deserializer::from_slice(value).into_iter::<Usage>().next() {
        Some(Ok(usage)) => Found::Report(usage),
        Some(Err(e)) if e.is_eof() => Found::Cut,
        _ => Found::Nothing,
    }
}

/// A prompt's tokens estimated from its bytes (about four per token for English text).
pub(crate) fn estimate_tokens(prompt_bytes: usize) -> u64 {
    (prompt_bytes as u64).div_ceil(4)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_are_found_in_bodies_and_events() {
        let mut whole = UsageMeter::default();
        whole.observe(
            br#"{"id":"x","choices":[],"usage": {"prompt_tokens":7,"total_tokens":9,"completion_tokens":2}}"#,
            0,
        );
        assert_eq!(whole.tokens(100), (7, 2, false));

        let mut stream = UsageMeter::default();
        stream.observe(b"data: {\"choices\":[{\"delta\":{}}],\"usage\":null}\n\n", 1);
        stream.observe(
            b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":4}}\n\ndata: [DONE]\n\n",
            2,
        );
        assert_eq!(stream.tokens(100), (3, 4, false));

        let mut anthropic = UsageMeter::default();
        anthropic.observe(br#"{"type":"message","usage":{"input_tokens":5,"output_tokens":6}}"#, 0);
        assert_eq!(anthropic.tokens(0), (5, 6, false));
    }

    #[test]
    fn a_report_cut_between_pieces_is_read_whole() {
        let mut meter = UsageMeter::default();
        meter.observe(b"data: {\"choices\":[],\"usage\":{\"prompt_tok", 0);
        meter.observe(b"ens\":11,\"completion_tokens\":12}}\n\n", 1);
        assert_eq!(meter.tokens(0), (11, 12, false));
    }

    #[test]
    fn without_a_report_tokens_are_estimated() {
        let mut stream = UsageMeter::default();
        stream.observe(b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: {}\n\ndata: [DONE]\n\n", 3);
        assert_eq!(stream.tokens(10), (10, 2, true));
        let mut whole = UsageMeter::default();
        whole.observe(&[b'x'; 40], 0);
        assert_eq!(whole.tokens(10), (10, 10, true));
        let mut broken = UsageMeter::default();
        broken.observe(br#"{"usage":{"prompt_tokens":"many"}}"#, 0);
        assert!(broken.tokens(1).2, "an unreadable report is no report");
    }
}
