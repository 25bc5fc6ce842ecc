//! The body decoder against a reference model, on arbitrary framings split at arbitrary points.
//!
//! The reference reads a whole chunked body at once, by index arithmetic, as RFC 9112 section 7.1
//! describes it; the decoder under test reads it incrementally, in whatever pieces the socket
//! gives. For every input and every way of cutting it, both must agree: the same data, the same
//! ending (done, waiting for more, or broken), and the bytes after the body left in the buffer.

use bytes::BytesMut;
use proptest::prelude::*;

use super::{decode, Chunk, Framing, MAX_CHUNK_LINE};

/// How a whole input ends, by the reference.
#[derive(Debug, PartialEq, Eq)]
enum Ending {
    /// The body ended; what follows it starts at `used`.
    Done {
        used: usize,
    },
    /// More bytes are needed.
    Waiting,
    Broken,
}

/// The reference: a chunked body read whole, and the data it carries up to where it ends.
fn reference(wire: &[u8]) -> (Vec<u8>, Ending) {
    let mut data = Vec::new();
    let mut at = 0;
    // A line from `at`: its length, or the ending when there is no whole line.
    let line = |at: usize| -> Result<usize, Ending> {
        match wire[at..].windows(2).position(|w| w == b"\r\n") {
            Some(end) if end > MAX_CHUNK_LINE => Err(Ending::Broken),
            Some(end) => Ok(end),
            None if wire.len() - at > MAX_CHUNK_LINE => Err(Ending::Broken),
            None => Err(Ending::Waiting),
        }
    };
    loop {
        let end = match line(at) {
            Ok(end) => end,
            Err(ending) => return (data, ending),
        };
        let digits = wire[at..at + end].split(|&b| b == b';').next().unwrap_or_default().trim_ascii();
        let valid = !digits.is_empty() && digits.len() <= 15 && digits.iter().all(u8::is_ascii_hexdigit);
        if !valid {
            return (data, Ending::Broken);
        }
        let size = usize::from_str_radix(std::str::from_utf8(digits).unwrap(), 16).unwrap();
        at += end + 2;
        if size == 0 {
            loop {
                let end = match line(at) {
                    Ok(end) => end,
                    Err(ending) => return (data, ending),
                };
                at += end + 2;
                if end == 0 {
                    return (data, Ending::Done { used: at });
                }
            }
        }
        if wire.len() - at < size {
            data.extend_from_slice(&wire[at..]);
            return (data, Ending::Waiting);
        }
        data.extend_from_slice(&wire[at..at + size]);
        at += size;
        if wire.len() - at < 2 {
            return (data, Ending::Waiting);
        }
        if &wire[at..at + 2] != b"\r\n" {
            return (data, Ending::Broken);
        }
        at += 2;
    }
}

/// The decoder fed `wire` in pieces ending at `cuts`: the data, how it ended, what is left.
fn incremental(wire: &[u8], cuts: &[usize], mut framing: Framing) -> (Vec<u8>, Ending, Vec<u8>) {
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (wire.len() + 1)).collect();
    points.push(wire.len());
    points.sort_unstable();
    let mut buffer = BytesMut::new();
    let mut data = Vec::new();
    let mut fed = 0;
    for point in points {
        buffer.extend_from_slice(&wire[fed..point]);
        fed = point;
        // Decode until it needs more: one read may hold the body's end and an error after data.
        loop {
            match decode(&mut buffer, &mut framing) {
                Err(_) => return (data, Ending::Broken, buffer.to_vec()),
                Ok(decoded) => {
                    let got = decoded.data.is_some();
                    data.extend_from_slice(&decoded.data.unwrap_or_default());
                    if decoded.done {
                        let used = fed - buffer.len();
                        let mut rest = buffer.to_vec();
                        rest.extend_from_slice(&wire[fed..]);
                        return (data, Ending::Done { used }, rest);
                    }
                    if !got {
                        break;
                    }
                }
            }
        }
    }
    (data, Ending::Waiting, buffer.to_vec())
}

/// A chunked body on the wire, the data it carries, and where it ends.
#[derive(Debug, Clone)]
struct Written {
    wire: Vec<u8>,
    body: Vec<u8>,
    end: usize,
}

/// A chunked body as a node may write it: chunk sizes in either case, with leading zeros,
/// extensions and spaces; trailers; then the start of whatever follows on the connection.
fn well_formed() -> impl Strategy<Value = Written> {
    let chunk = (
        proptest::collection::vec(any::<u8>(), 1..200),
        any::<bool>(),
        0usize..3,
        proptest::option::of("[a-z]{1,8}(=[a-z0-9\"]{0,8})?"),
        any::<bool>(),
    );
    let trailers = proptest::collection::vec("[a-z-]{1,10}: [ -~]{0,20}", 0..3);
    (proptest::collection::vec(chunk, 0..8), trailers, proptest::collection::vec(any::<u8>(), 0..20)).prop_map(
        |(chunks, trailers, after)| {
            let mut wire = Vec::new();
            let mut body = Vec::new();
            for (data, upper, zeros, extension, space) in chunks {
                let size = if upper { format!("{:X}", data.len()) } else { format!("{:x}", data.len()) };
                wire.extend_from_slice("0".repeat(zeros).as_bytes());
                wire.extend_from_slice(size.as_bytes());
                if space {
                    wire.push(b' ');
                }
                if let Some(extension) = extension {
                    wire.extend_from_slice(format!(";{extension}").as_bytes());
                }
                wire.extend_from_slice(b"\r\n");
                wire.extend_from_slice(&data);
                wire.extend_from_slice(b"\r\n");
                body.extend_from_slice(&data);
            }
            wire.extend_from_slice(b"0\r\n");
            for trailer in trailers {
                wire.extend_from_slice(trailer.as_bytes());
                wire.extend_from_slice(b"\r\n");
            }
            wire.extend_from_slice(b"\r\n");
            let end = wire.len();
            wire.extend_from_slice(&after);
            Written { wire, body, end }
        },
    )
}

/// Bytes from an alphabet a chunked decoder cares about, so that most inputs get far.
fn framing_bytes() -> impl Strategy<Value = Vec<u8>> {
    let byte = prop_oneof![
        4 => proptest::sample::select(b"0123456789abcdefABCDEF".to_vec()),
        3 => Just(b'\r'),
        3 => Just(b'\n'),
        1 => proptest::sample::select(b"; =\tgxyz-:".to_vec()),
        1 => any::<u8>(),
    ];
    proptest::collection::vec(byte, 0..300)
}

/// `wire` with a few bytes changed, removed or added.
fn mutated() -> impl Strategy<Value = Vec<u8>> {
    (well_formed(), proptest::collection::vec((any::<usize>(), 0u8..3, any::<u8>()), 1..4)).prop_map(
        |(Written { mut wire, .. }, edits)| {
            for (at, how, byte) in edits {
                if wire.is_empty() {
                    break;
                }
                let at = at % wire.len();
                match how {
                    0 => wire[at] = byte,
                    1 => {
                        wire.remove(at);
                    }
                    _ => wire.insert(at, byte),
                }
            }
            wire
        },
    )
}

fn agrees_with_the_reference(wire: &[u8], cuts: &[usize]) -> Result<(), TestCaseError> {
    let (expected, ending) = reference(wire);
    let (data, got, rest) = incremental(wire, cuts, Framing::Chunked(Chunk::Size));
    prop_assert_eq!(&got, &ending, "ending of {:?} cut at {:?}", String::from_utf8_lossy(wire), cuts);
    prop_assert_eq!(&data, &expected, "data");
    if let Ending::Done { used } = ending {
        prop_assert_eq!(&rest[..], &wire[used..], "what follows the body is left as it came");
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn well_formed_bodies_decode_whole_at_any_cuts(
        written in well_formed(),
        cuts in proptest::collection::vec(any::<usize>(), 0..12),
    ) {
        let Written { wire, body, end } = written;
        let (data, ending, rest) = incremental(&wire, &cuts, Framing::Chunked(Chunk::Size));
        prop_assert_eq!(ending, Ending::Done { used: end });
        prop_assert_eq!(&data, &body);
        prop_assert_eq!(&rest[..], &wire[end..]);
        agrees_with_the_reference(&wire, &cuts)?;
    }

    #[test]
    fn arbitrary_framing_agrees_with_the_reference(
        wire in framing_bytes(),
        cuts in proptest::collection::vec(any::<usize>(), 0..12),
    ) {
        agrees_with_the_reference(&wire, &cuts)?;
    }

    #[test]
    fn sizes_of_any_width_agree_with_the_reference(
        size in "[0-9a-fA-F]{1,20}",
        rest in framing_bytes(),
        cuts in proptest::collection::vec(any::<usize>(), 0..12),
    ) {
        let wire = [size.as_bytes(), b"\r\n", &rest].concat();
        agrees_with_the_reference(&wire, &cuts)?;
    }

    #[test]
    fn damaged_bodies_agree_with_the_reference(
        wire in mutated(),
        cuts in proptest::collection::vec(any::<usize>(), 0..12),
    ) {
        agrees_with_the_reference(&wire, &cuts)?;
    }

    #[test]
    fn a_long_line_is_refused_however_it_arrives(
        extension in (MAX_CHUNK_LINE - 40)..(MAX_CHUNK_LINE + 40),
        trailer in any::<bool>(),
        cuts in proptest::collection::vec(any::<usize>(), 0..4),
    ) {
        let long = "x".repeat(extension);
        let wire = if trailer {
            format!("3\r\nabc\r\n0\r\nx-long: {long}\r\n\r\n")
        } else {
            format!("3;{long}\r\nabc\r\n0\r\n\r\n")
        };
        agrees_with_the_reference(wire.as_bytes(), &cuts)?;
    }

    #[test]
    fn lengths_take_exactly_their_bytes(
        wire in proptest::collection::vec(any::<u8>(), 0..400),
        length in 0u64..400,
        cuts in proptest::collection::vec(any::<usize>(), 0..12),
    ) {
        let (data, ending, rest) = incremental(&wire, &cuts, Framing::Length(length));
        let take = usize::try_from(length).unwrap().min(wire.len());
        prop_assert_eq!(&data[..], &wire[..take]);
        if take as u64 == length {
            prop_assert_eq!(ending, Ending::Done { used: take });
            prop_assert_eq!(&rest[..], &wire[take..]);
        } else {
            prop_assert_eq!(ending, Ending::Waiting);
        }
    }
}
