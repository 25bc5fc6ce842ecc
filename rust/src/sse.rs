//! Server-sent-event framing: where the last complete event in a buffer ends.
//!
//! The forwarder never re-frames events; it only decides where it may cut a buffer so that
//! each batch handed to Python holds whole events. An event ends at a blank line, and the
//! SSE grammar allows `\n`, `\r\n` or `\r` as line terminators.

/// Returns the length of the longest prefix of `buf` that ends exactly at an event boundary,
/// looking for boundaries only at or after `from` (earlier bytes were scanned already).
pub(crate) fn last_event_end(buf: &[u8], from: usize) -> Option<usize> {
    // A boundary may straddle the previous scan position by up to three bytes (`\r\n\r\n`).
    let start = from.saturating_sub(3);
    let region = &buf[start..];
    let mut end = region.len();
    while let Some(pos) = memchr::memrchr2(b'\n', b'\r', &region[..end]) {
        let abs = start + pos;
        if ends_blank_line(buf, abs) {
            return Some(abs + 1);
        }
        end = pos;
    }
    None
}

/// True when the terminator at `pos` closes an empty line, i.e. ends an event.
fn ends_blank_line(buf: &[u8], pos: usize) -> bool {
    let before = |n: usize| pos.checked_sub(n).map(|i| buf[i]);
    match buf[pos] {
        // `\n\n`; or `\r\n` closing an empty line (`\r\n\r\n`, `\n\r\n`, `\r\r\n`).
        b'\n' => match before(1) {
            Some(b'\n') => true,
            Some(b'\r') => matches!(before(2), Some(b'\n' | b'\r')),
            _ => false,
        },
        // `\r\r`, unless the next byte is a `\n` that may still complete a `\r\n`.
        b'\r' => before(1) == Some(b'\r') && buf.get(pos + 1).is_none_or(|&b| b != b'\n'),
        _ => false,
    }
}

/// True when a `content-type` header value announces an event stream.
pub(crate) fn is_event_stream(content_type: &[u8]) -> bool {
    content_type.len() >= 17 && content_type[..17].eq_ignore_ascii_case(b"text/event-stream")
}

/// Counts event ends (a blank line) in `chunk`; `last_was_newline` carries across chunks.
pub(crate) fn count_events(chunk: &[u8], last_was_newline: &mut bool) -> u64 {
    let mut events = 0;
    for pos in memchr::memchr_iter(b'\n', chunk) {
        let previous = if pos == 0 { *last_was_newline } else { chunk[pos - 1] == b'\n' };
        if previous || (pos >= 2 && chunk[pos - 1] == b'\r' && chunk[pos - 2] == b'\n') {
            events += 1;
        }
    }
    if let Some(&last) = chunk.last() {
        *last_was_newline = last == b'\n';
    }
    events
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lf_boundaries() {
        let buf = b"data: 1\n\ndata: 2\n\ndata: 3";
        assert_eq!(last_event_end(buf, 0), Some(18));
        assert_eq!(last_event_end(b"data: 1\n", 0), None);
        assert_eq!(last_event_end(b"data: 1\n\n", 0), Some(9));
    }

    #[test]
    fn crlf_boundaries() {
        let buf = b"data: 1\r\n\r\ndata: 2\r\n";
        assert_eq!(last_event_end(buf, 0), Some(11));
        // Half a CRLF CRLF is not a boundary yet.
        assert_eq!(last_event_end(b"data: 1\r\n\r", 0), None);
    }

    #[test]
    fn cr_boundaries() {
        assert_eq!(last_event_end(b"data: 1\r\rdata: 2", 0), Some(9));
    }

    #[test]
    fn scan_resumes_across_chunk_edges() {
        // The boundary straddles the previously scanned prefix.
        let buf = b"data: 1\r\n\r\n";
        assert_eq!(last_event_end(buf, 9), Some(11));
        assert_eq!(last_event_end(b"data: 1\n\n", 8), Some(9));
    }

    #[test]
    fn counts_events_across_chunks() {
        let mut nl = false;
        assert_eq!(count_events(b"data: 1\n\ndata: 2\n", &mut nl), 1);
        assert_eq!(count_events(b"\ndata: 3\r\n\r\n", &mut nl), 2);
    }

    #[test]
    fn content_type() {
        assert!(is_event_stream(b"text/event-stream; charset=utf-8"));
        assert!(is_event_stream(b"Text/Event-Stream"));
        assert!(!is_event_stream(b"application/json"));
    }
}
