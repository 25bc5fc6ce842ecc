//! HTTP/1.1 on the wire, as the client needs it: the request written in one piece, the
//! response head parsed (httparse), and the body's framing decoded (length, chunked, or until
//! the node closes).

use std::future::poll_fn;
use std::io;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use http::header::{HeaderName, HeaderValue, CONNECTION, CONTENT_LENGTH, TRANSFER_ENCODING};
use http::{HeaderMap, Method, StatusCode};

use super::pool::{Connection, Stream};
use crate::coalesce::Coalescer;
use crate::headers::{is_hop_by_hop_name, listed_in_connection, stays_on_client_hop};
use crate::loops::VIA;
use crate::observe::trace::TRACEPARENT;
use crate::upstream::ForwardRequest;

/// Bytes asked of the socket per read at first, and at most: a read that fills what was asked
/// doubles the next one (a large body), one that fills less than half goes back to the first
/// size (events of a stream are small, and hundreds of streams each keep a buffer).
pub(crate) const READ_SIZE: usize = 4 * 1024;
const MAX_READ_SIZE: usize = 64 * 1024;
/// Largest response head accepted, and most headers in it.
const MAX_HEAD: usize = 64 * 1024;
const MAX_HEADERS: usize = 128;
/// Headers in a head read without a heap allocation.
const USUAL_HEADERS: usize = 16;
/// Where a header lies in a head's bytes: its name's offset and length, its value's.
type Span = (usize, usize, usize, usize);

/// What this proxy adds to a request for one node.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Hop<'a> {
    /// The node's own key.
    pub(crate) authorization: Option<&'a HeaderValue>,
    /// This proxy's id, last in `x-pdproxy-via` (see `crate::loops`).
    pub(crate) via: &'a HeaderValue,
    /// The attempt's trace context (`crate::observe::trace`), in place of the client's.
    pub(crate) traceparent: Option<&'a HeaderValue>,
}

/// Bodies up to this size are copied behind the head, so that the usual request is one write;
/// a larger one is written after it as it is (`body_after_head`), never copied.
pub(crate) const INLINE_BODY: usize = 64 * 1024;

/// The request line and headers, and the body when it is small, in one buffer. The client's
/// headers go without those of its own hop and those the proxy replaces (`extra`, the hop's);
/// then the proxy's, and the hop's.
pub(crate) fn encode_request(path: &str, authority: &str, request: &ForwardRequest, hop: &Hop<'_>) -> Vec<u8> {
    let ForwardRequest { method, headers, extra, body, .. } = request;
    let Hop { authorization, via, traceparent } = *hop;
    let inline = if body.len() <= INLINE_BODY { body.len() } else { 0 };
    let mut out = Vec::with_capacity(256 + headers.len() * 48 + inline);
    out.extend_from_slice(method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(path.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    out.extend_from_slice(authority.as_bytes());
    out.extend_from_slice(b"\r\n");
    let listed = listed_in_connection(headers);
    let clients = headers.iter().filter(|(name, _)| {
        !stays_on_client_hop(name)
            && **name != VIA
            && !extra.iter().any(|(replaced, _)| replaced == *name)
            && !listed.iter().any(|l| l.as_slice() == name.as_str().as_bytes())
            && (traceparent.is_none() || **name != TRACEPARENT)
    });
    let proxys = extra.iter().map(|(name, value)| (name, value));
    let key = authorization.map(|value| (&http::header::AUTHORIZATION, value));
    let trace = traceparent.map(|value| (&TRACEPARENT, value));
    for (name, value) in clients.chain(proxys).chain(key).chain(trace) {
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    // The proxies this request went through, this one last (see `crate::loops`).
    out.extend_from_slice(b"x-pdproxy-via: ");
    for earlier in headers.get_all(&VIA) {
        out.extend_from_slice(earlier.as_bytes());
        out.extend_from_slice(b", ");
    }
    out.extend_from_slice(via.as_bytes());
    out.extend_from_slice(b"\r\n");
    if !body.is_empty() || !matches!(*method, Method::GET | Method::HEAD) {
        out.extend_from_slice(b"content-length: ");
        out.extend_from_slice(itoa::Buffer::new().format(body.len()).as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(&body[..inline]);
    out
}

/// What goes after `encode_request`'s buffer: a body too large to copy into it.
pub(crate) fn body_after_head(request: &ForwardRequest) -> &[u8] {
    if request.body.len() > INLINE_BODY {
        &request.body
    } else {
        &[]
    }
}

/// How the body of an answer ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Framing {
    /// So many bytes still to come.
    Length(u64),
    Chunked(Chunk),
    /// Until the node closes the connection.
    Close,
    Done,
}

/// Where a chunked body's decoder stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Chunk {
    /// At a chunk-size line.
    Size,
    /// Inside a chunk: bytes of data left.
    Data(u64),
    /// After a chunk's data: its CRLF.
    DataEnd,
    /// After the last chunk: trailer lines up to an empty one.
    Trailers,
    /// The framing broke after data that was still delivered: the next decode fails.
    Broken(&'static str),
}

/// A response head.
#[derive(Debug)]
pub(crate) struct Head {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) framing: Framing,
    /// Whether the connection may carry another request once the body is read.
    pub(crate) reusable: bool,
}

#[derive(Debug)]
pub(crate) enum HeadError {
    /// The connection ended before any byte of an answer.
    Closed,
    Io(io::Error),
    Invalid(&'static str),
}

/// Reads from the socket into the connection's buffer; `Ok(0)` at its end.
pub(crate) fn poll_fill(connection: &mut Connection, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
    connection.buffer.reserve(connection.read_size);
    let asked = connection.buffer.capacity() - connection.buffer.len();
    // `poll_read` (not `try_read`): tokio takes a short read to mean the socket is drained and
    // waits for the next readiness, which saves a read that would only say "would block" after
    // every burst from the node (one per event on a stream).
    let read = match &mut connection.stream {
        Stream::Plain(tcp) => tokio_util::io::poll_read_buf(std::pin::Pin::new(tcp), cx, &mut connection.buffer),
        Stream::Tls(tls) => tokio_util::io::poll_read_buf(std::pin::Pin::new(tls.as_mut()), cx, &mut connection.buffer),
    };
    if let Poll::Ready(Ok(n)) = read {
        connection.read_size = if n >= asked {
            (connection.read_size * 2).min(MAX_READ_SIZE)
        } else if n < connection.read_size / 2 {
            READ_SIZE
        } else {
            connection.read_size
        };
    }
    read
}

/// Reads the answer's head (skipping interim 1xx answers), leaving the body's first bytes in
/// the buffer.
pub(crate) async fn read_head(connection: &mut Connection, method: &Method) -> Result<Head, HeadError> {
    let mut any = !connection.buffer.is_empty();
    loop {
        if !connection.buffer.is_empty() {
            if let Some(head) = parse_head(&mut connection.buffer, method)? {
                if head.status.is_informational() {
                    continue;
                }
                return Ok(head);
            }
            if connection.buffer.len() > MAX_HEAD {
                return Err(HeadError::Invalid("the response head is too large"));
            }
        }
        match poll_fn(|cx| poll_fill(connection, cx)).await {
            Ok(0) if !any => return Err(HeadError::Closed),
            Ok(0) => return Err(HeadError::Invalid("the node closed the connection in the middle of its head")),
            Ok(_) => any = true,
            Err(e) if !any && matches!(e.kind(), io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe) => {
                return Err(HeadError::Closed);
            }
            Err(e) => return Err(HeadError::Io(e)),
        }
    }
}

/// Parses a whole head at the start of `buffer` and takes it out; `None` while it is partial.
/// Header values are slices of the head's bytes, not copies.
fn parse_head(buffer: &mut BytesMut, method: &Method) -> Result<Option<Head>, HeadError> {
    let mut slots = [const { std::mem::MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut response = httparse::Response::new(&mut []);
    let used =
        match httparse::ParserConfig::default().parse_response_with_uninit_headers(&mut response, buffer, &mut slots) {
            Ok(httparse::Status::Complete(used)) => used,
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(_) => return Err(HeadError::Invalid("the response head does not parse")),
        };
    let status = response
        .code
        .filter(|c| (100..=599).contains(c))
        .and_then(|c| StatusCode::from_u16(c).ok())
        .ok_or(HeadError::Invalid("the answer's status is not an HTTP status"))?;
    if status == StatusCode::SWITCHING_PROTOCOLS {
        return Err(HeadError::Invalid("the node switched protocols unasked"));
    }
    let http11 = response.version == Some(1);
    // Where each name and value lies in the buffer, to slice them once the head is taken out;
    // on the stack for a usual head (a heap list is one more allocation for every answer).
    let base = buffer.as_ptr() as usize;
    let span = |h: &httparse::Header<'_>| -> Span {
        (h.name.as_ptr() as usize - base, h.name.len(), h.value.as_ptr() as usize - base, h.value.len())
    };
    let mut usual: [Span; USUAL_HEADERS] = [(0, 0, 0, 0); USUAL_HEADERS];
    let many: Vec<Span>;
    let spans = if response.headers.len() <= USUAL_HEADERS {
        for (slot, h) in usual.iter_mut().zip(response.headers.iter()) {
            *slot = span(h);
        }
        &usual[..response.headers.len()]
    } else {
        many = response.headers.iter().map(span).collect();
        &many[..]
    };
    let raw = buffer.split_to(used).freeze();
    let mut headers = HeaderMap::with_capacity(spans.len());
    // The node's hop (connection, framing) is read from here, not passed on.
    let mut hop = HeaderMap::new();
    let mut length = Length::Absent;
    for &(name_at, name_len, value_at, value_len) in spans {
        let name = HeaderName::from_bytes(&raw[name_at..name_at + name_len])
            .map_err(|_| HeadError::Invalid("bad header name"))?;
        let value = HeaderValue::from_maybe_shared(raw.slice(value_at..value_at + value_len))
            .map_err(|_| HeadError::Invalid("bad header value"))?;
        if is_hop_by_hop_name(&name) {
            hop.append(name, value);
        } else {
            if name == CONTENT_LENGTH {
                length = length.and(value.as_bytes())?;
            }
            headers.append(name, value);
        }
    }
    for listed in listed_in_connection(&hop) {
        if let Ok(name) = HeaderName::from_bytes(&listed) {
            if name == CONTENT_LENGTH {
                length = Length::Absent;
            }
            headers.remove(name);
        }
    }
    let closes = hop.get_all(CONNECTION).iter().any(|v| has_token(v.as_bytes(), b"close"));
    let keeps = hop.get_all(CONNECTION).iter().any(|v| has_token(v.as_bytes(), b"keep-alive"));
    let mut reusable = (http11 && !closes) || (!http11 && keeps);
    let no_body = *method == Method::HEAD
        || status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED;
    let chunked = is_chunked(&hop)?;
    let framing = match (no_body, chunked, length) {
        (true, _, _) => Framing::Done,
        // RFC 9112 section 6.3: a message with both may be an attempt at response splitting.
        (false, true, Length::Is(_)) => {
            return Err(HeadError::Invalid("the answer has both transfer-encoding and content-length"))
        }
        (false, true, _) => Framing::Chunked(Chunk::Size),
        (false, false, Length::Is(length)) => Framing::Length(length),
        (false, false, Length::Absent) => {
            reusable = false;
            Framing::Close
        }
    };
    Ok(Some(Head { status, headers, framing, reusable }))
}

/// A head's `content-length`, read strictly: digits only, and every value the same.
#[derive(Debug, Clone, Copy)]
enum Length {
    Absent,
    Is(u64),
}

impl Length {
    /// This length with one more `content-length` value (itself a list, perhaps).
    fn and(self, value: &[u8]) -> Result<Self, HeadError> {
        let mut known = self;
        for item in value.split(|&b| b == b',') {
            let digits = item.trim_ascii();
            let parsed = (!digits.is_empty() && digits.len() <= 19 && digits.iter().all(u8::is_ascii_digit))
                .then(|| digits.iter().fold(0u64, |n, &d| n * 10 + u64::from(d - b'0')))
                .ok_or(HeadError::Invalid("bad content-length"))?;
            known = match known {
                Length::Is(earlier) if earlier != parsed => {
                    return Err(HeadError::Invalid("the answer has conflicting content-lengths"))
                }
                _ => Length::Is(parsed),
            };
        }
        Ok(known)
    }
}

/// Whether the answer's transfer coding is chunked; any other coding, or chunked more than
/// once, is refused (the proxy would pass on a body whose coding it dropped).
fn is_chunked(hop: &HeaderMap) -> Result<bool, HeadError> {
    let mut codings = hop.get_all(TRANSFER_ENCODING).iter().flat_map(|v| v.as_bytes().split(|&b| b == b','));
    match (codings.next(), codings.next()) {
        (None, _) => Ok(false),
        (Some(only), None) if only.trim_ascii().eq_ignore_ascii_case(b"chunked") => Ok(true),
        _ => Err(HeadError::Invalid("the answer's transfer coding is not plain chunked")),
    }
}

fn has_token(value: &[u8], token: &[u8]) -> bool {
    value.split(|&b| b == b',').any(|t| t.trim_ascii().eq_ignore_ascii_case(token))
}

/// What decoding the buffer gave.
#[derive(Debug, Default)]
pub(crate) struct Decoded {
    /// Body bytes, all that the buffer held.
    pub(crate) data: Option<Bytes>,
    pub(crate) done: bool,
}

/// Decodes what `buffer` holds of the body; needs more bytes when it returns neither data nor done.
pub(crate) fn decode(buffer: &mut BytesMut, framing: &mut Framing) -> Result<Decoded, &'static str> {
    match framing {
        Framing::Done => Ok(Decoded { data: None, done: true }),
        Framing::Close => Ok(Decoded { data: (!buffer.is_empty()).then(|| buffer.split().freeze()), done: false }),
        Framing::Length(left) => {
            let take = usize::try_from(*left).unwrap_or(usize::MAX).min(buffer.len());
            let data = (take > 0).then(|| buffer.split_to(take).freeze());
            *left -= take as u64;
            let done = *left == 0;
            if done {
                *framing = Framing::Done;
            }
            Ok(Decoded { data, done })
        }
        Framing::Chunked(state) => {
            let mut out = Coalescer::default();
            let done = decode_chunks(buffer, state, &mut out)?;
            if done {
                *framing = Framing::Done;
            }
            Ok(Decoded { data: out.take(), done })
        }
    }
}

/// Decodes every whole piece of a chunked body in `buffer`; true at the end of the body. The data
/// decoded before a broken piece is delivered first; the error comes with the next decode.
fn decode_chunks(buffer: &mut BytesMut, state: &mut Chunk, out: &mut Coalescer) -> Result<bool, &'static str> {
    match decode_pieces(buffer, state, out) {
        Err(why) if !out.is_empty() => {
            *state = Chunk::Broken(why);
            Ok(false)
        }
        decoded => decoded,
    }
}

fn decode_pieces(buffer: &mut BytesMut, state: &mut Chunk, out: &mut Coalescer) -> Result<bool, &'static str> {
    loop {
        match *state {
            Chunk::Size => {
                let Some(end) = find_crlf(buffer)? else { return Ok(false) };
                let line = &buffer[..end];
                let digits = line.split(|&b| b == b';').next().unwrap_or_default().trim_ascii();
                let size = parse_hex(digits).ok_or("bad chunk size")?;
                buffer.advance(end + 2);
                *state = if size == 0 { Chunk::Trailers } else { Chunk::Data(size) };
            }
            Chunk::Data(left) => {
                if buffer.is_empty() {
                    return Ok(false);
                }
                let take = usize::try_from(left).unwrap_or(usize::MAX).min(buffer.len());
                out.push(buffer.split_to(take).freeze());
                let left = left - take as u64;
                *state = if left == 0 { Chunk::DataEnd } else { Chunk::Data(left) };
            }
            Chunk::DataEnd => {
                if buffer.len() < 2 {
                    return Ok(false);
                }
                if &buffer[..2] != b"\r\n" {
                    return Err("a chunk does not end with CRLF");
                }
                buffer.advance(2);
                *state = Chunk::Size;
            }
            Chunk::Trailers => {
                let Some(end) = find_crlf(buffer)? else { return Ok(false) };
                buffer.advance(end + 2);
                if end == 0 {
                    return Ok(true);
                }
            }
            Chunk::Broken(why) => return Err(why),
        }
    }
}

/// Built once: `memmem::find` would build its searcher again on every line.
static CRLF: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\r\n"));

/// Longest chunk-size or trailer line accepted.
const MAX_CHUNK_LINE: usize = 4096;

/// Where the first CRLF is; an over-long line is an error, however it arrived (in one read or
/// in several).
fn find_crlf(buffer: &[u8]) -> Result<Option<usize>, &'static str> {
    match CRLF.find(buffer) {
        Some(end) if end > MAX_CHUNK_LINE => Err("a chunk line is too long"),
        Some(end) => Ok(Some(end)),
        // A read that ends between a line's CR and its LF holds the CR besides the line.
        None if buffer.len() - usize::from(buffer.ends_with(b"\r")) > MAX_CHUNK_LINE => Err("a chunk line is too long"),
        None => Ok(None),
    }
}

fn parse_hex(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() || digits.len() > 15 {
        return None;
    }
    digits.iter().try_fold(0u64, |n, &d| Some(n * 16 + u64::from(char::from(d).to_digit(16)?)))
}

#[cfg(test)]
mod properties;

#[cfg(test)]
mod tests {
    use super::*;

    fn all(input: &[&[u8]], mut framing: Framing) -> (Vec<u8>, bool) {
        let mut buffer = BytesMut::new();
        let mut out = Vec::new();
        for piece in input {
            buffer.extend_from_slice(piece);
            let d = decode(&mut buffer, &mut framing).unwrap();
            out.extend_from_slice(&d.data.unwrap_or_default());
            if d.done {
                return (out, true);
            }
        }
        (out, false)
    }

    #[test]
    fn chunked_bodies_decode_across_any_cut() {
        let wire = b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\nx-trailer: 1\r\n\r\n";
        for cut in 1..wire.len() {
            let (data, done) = all(&[&wire[..cut], &wire[cut..]], Framing::Chunked(Chunk::Size));
            assert_eq!((data.as_slice(), done), (&b"hello, world"[..], true), "cut at {cut}");
        }
        let mut buffer = BytesMut::from(&b"zz\r\n"[..]);
        assert!(decode(&mut buffer, &mut Framing::Chunked(Chunk::Size)).is_err());
    }

    #[test]
    fn several_chunks_in_one_read_are_one_piece() {
        let mut buffer = BytesMut::from(&b"3\r\nabc\r\n3\r\ndef\r\n1\r\ng"[..]);
        let mut framing = Framing::Chunked(Chunk::Size);
        let d = decode(&mut buffer, &mut framing).unwrap();
        assert_eq!(d.data.as_deref(), Some(&b"abcdefg"[..]));
        assert!(!d.done && buffer.is_empty());
    }

    #[test]
    fn lengths_and_heads() {
        let (data, done) = all(&[b"ab", b"cdef"], Framing::Length(5));
        assert_eq!((data.as_slice(), done), (&b"abcde"[..], true));
        let parse = |raw: &[u8]| parse_head(&mut BytesMut::from(raw), &Method::POST);
        let mut buffer =
            BytesMut::from(&b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: keep-alive\r\nx-a: b\r\n\r\nhi"[..]);
        let head = parse_head(&mut buffer, &Method::POST).unwrap().unwrap();
        assert_eq!((head.status, head.framing, head.reusable), (StatusCode::OK, Framing::Length(2), true));
        assert_eq!((&buffer[..], head.headers["x-a"].as_bytes()), (&b"hi"[..], &b"b"[..]));
        assert!(parse(b"HTTP/1.1 200 OK\r\ncontent-le").unwrap().is_none(), "partial");
        let head = parse(b"HTTP/1.0 200 OK\r\n\r\n").unwrap().unwrap();
        assert_eq!((head.framing, head.reusable), (Framing::Close, false));
        let head = parse(b"HTTP/1.1 204 No Content\r\nconnection: close\r\n\r\n").unwrap().unwrap();
        assert_eq!((head.framing, head.reusable), (Framing::Done, false));
        assert!(parse(b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n").is_err());
        // A length the node's hop lists as its own is not the body's framing.
        let head = parse(b"HTTP/1.1 200 OK\r\nconnection: content-length\r\ncontent-length: 2\r\n\r\n").unwrap();
        assert_eq!(head.unwrap().framing, Framing::Close);
        // More headers than a head usually has: every one is kept, each with its own value.
        let mut many = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n".to_vec();
        for i in 0..USUAL_HEADERS * 2 {
            many.extend_from_slice(format!("x-h{i}: v{i}\r\n").as_bytes());
        }
        many.extend_from_slice(b"\r\n");
        let head = parse(&many).unwrap().unwrap();
        assert_eq!((head.framing, head.headers.len()), (Framing::Length(0), USUAL_HEADERS * 2 + 1));
        assert_eq!(head.headers["x-h31"], "v31");
    }

    #[test]
    fn ambiguous_framing_is_refused() {
        let parse = |raw: &[u8]| parse_head(&mut BytesMut::from(raw), &Method::POST);
        for bad in [
            &b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 3\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: 5, 3\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: +5\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: 99999999999999999999\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n",
            b"HTTP/1.1 999 Odd\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 101 Switching Protocols\r\nupgrade: x\r\n\r\n",
        ] {
            assert!(parse(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
        // What a strict reading still takes: a repeated equal length, and chunked in any case.
        let head = parse(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 5, 5\r\n\r\n").unwrap();
        assert_eq!(head.unwrap().framing, Framing::Length(5));
        let head = parse(b"HTTP/1.1 200 OK\r\ntransfer-encoding: Chunked\r\n\r\n").unwrap();
        assert_eq!(head.unwrap().framing, Framing::Chunked(Chunk::Size));
    }

    #[test]
    fn data_before_a_broken_chunk_is_delivered_first() {
        let mut buffer = BytesMut::from(&b"5\r\nhello\r\nzz\r\n"[..]);
        let mut framing = Framing::Chunked(Chunk::Size);
        let d = decode(&mut buffer, &mut framing).unwrap();
        assert_eq!((d.data.as_deref(), d.done), (Some(&b"hello"[..]), false));
        assert!(decode(&mut buffer, &mut framing).is_err(), "then the error");
    }

    fn request(
        method: Method,
        headers: &[(&'static str, &'static str)],
        extra: &[(&'static str, &'static str)],
        body: &'static [u8],
    ) -> ForwardRequest {
        let pair = |(n, v): &(&'static str, &'static str)| (HeaderName::from_static(n), HeaderValue::from_static(v));
        ForwardRequest {
            method,
            path_and_query: String::new(),
            headers: headers.iter().map(pair).collect(),
            extra: extra.iter().map(pair).collect(),
            body: Bytes::from_static(body),
        }
    }

    #[test]
    fn requests_are_one_buffer_without_the_clients_hop() {
        let client = [
            ("x-a", "1"),
            ("host", "proxy"),
            ("authorization", "Bearer client"),
            ("connection", "x-hop"),
            ("x-hop", "2"),
            ("content-length", "2"),
            ("x-forwarded-for", "1.2.3.4"),
        ];
        let sent = request(Method::POST, &client, &[("x-forwarded-for", "1.2.3.4, 10.0.0.1")], b"{}");
        let key = HeaderValue::from_static("Bearer k");
        let me = HeaderValue::from_static("me");
        let hop = Hop { authorization: Some(&key), via: &me, traceparent: None };
        let out = encode_request("/v1/x?y=1", "h:1", &sent, &hop);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "POST /v1/x?y=1 HTTP/1.1\r\nhost: h:1\r\nx-a: 1\r\nx-forwarded-for: 1.2.3.4, 10.0.0.1\r\n\
             authorization: Bearer k\r\nx-pdproxy-via: me\r\ncontent-length: 2\r\n\r\n{}"
        );
        let earlier = request(Method::GET, &[("x-pdproxy-via", "a, b")], &[], b"");
        let out = encode_request("/health", "h:1", &earlier, &Hop { authorization: None, via: &me, traceparent: None });
        assert_eq!(out, b"GET /health HTTP/1.1\r\nhost: h:1\r\nx-pdproxy-via: a, b, me\r\n\r\n");
    }

    #[test]
    fn the_attempts_trace_context_replaces_the_clients() {
        let sent = request(Method::GET, &[("traceparent", "00-aa-bb-01"), ("tracestate", "k=v")], &[], b"");
        let me = HeaderValue::from_static("me");
        let ours = HeaderValue::from_static("00-cc-dd-01");
        let out = encode_request("/x", "h:1", &sent, &Hop { authorization: None, via: &me, traceparent: Some(&ours) });
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "GET /x HTTP/1.1\r\nhost: h:1\r\ntracestate: k=v\r\ntraceparent: 00-cc-dd-01\r\nx-pdproxy-via: me\r\n\r\n"
        );
        let untraced = encode_request("/x", "h:1", &sent, &Hop { authorization: None, via: &me, traceparent: None });
        assert!(String::from_utf8(untraced).unwrap().contains("traceparent: 00-aa-bb-01"), "passed on as is");
    }
}
