//! The datagram a replica sends its peers: its own load on every node, in a fixed
//! little-endian layout that needs no clock shared between hosts (times are left, not due).
//!
//! ```text
//! header (26 bytes): "pdr" | version u8 | replica u64 | seq u64 | part u16 | parts u16 | count u16
//! entry  (20 bytes): node key u64 | unanswered u32 | prefill left (µs) u32 | in flight u32
//! ```
//!
//! A snapshot of many nodes is split into `parts` datagrams of one `seq`, each under
//! `MAX_DATAGRAM` bytes (no IP fragmentation on any usual path MTU).

/// The first three bytes of every datagram, then the version.
const MAGIC: [u8; 3] = *b"pdr";
const VERSION: u8 = 2;
const HEADER: usize = 26;
const ENTRY: usize = 20;
/// The largest datagram sent: under the 1,280 bytes IPv6 guarantees, with room for headers.
pub(crate) const MAX_DATAGRAM: usize = 1200;
/// Nodes per datagram.
pub(crate) const ENTRIES_PER_DATAGRAM: usize = (MAX_DATAGRAM - HEADER) / ENTRY;

/// One replica's own load on one node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Figures {
    /// Requests it sent there that wait for their first byte.
    pub(crate) unanswered: u32,
    /// The prefill it still expects the node to owe them, microseconds from the sending.
    pub(crate) prefill_left_us: u32,
    /// Requests it sent there not yet ended (decoding, most of them).
    pub(crate) in_flight: u32,
}

/// One decoded datagram: part `part` of `parts` of snapshot `seq` of replica `replica`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Datagram {
    pub(crate) replica: u64,
    pub(crate) seq: u64,
    pub(crate) part: u16,
    pub(crate) parts: u16,
    pub(crate) entries: Vec<(u64, Figures)>,
}

/// A node's key: FNV-1a (64-bit) of its normalised URL, the same on every replica and every
/// build (the standard library's hasher promises neither).
pub(crate) fn node_key(url: &str) -> u64 {
    url.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, byte| (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3))
}

/// The datagrams of one snapshot (at least one: an empty one still says the replica is alive).
pub(crate) fn encode(replica: u64, seq: u64, entries: &[(u64, Figures)]) -> Vec<Vec<u8>> {
    let chunks: Vec<&[(u64, Figures)]> =
        if entries.is_empty() { vec![&[]] } else { entries.chunks(ENTRIES_PER_DATAGRAM).collect() };
    let parts = u16::try_from(chunks.len()).unwrap_or(u16::MAX);
    chunks
        .iter()
        .take(usize::from(parts))
        .enumerate()
        .map(|(part, chunk)| {
            let mut out = Vec::with_capacity(HEADER + chunk.len() * ENTRY);
            out.extend_from_slice(&MAGIC);
            out.push(VERSION);
            out.extend_from_slice(&replica.to_le_bytes());
            out.extend_from_slice(&seq.to_le_bytes());
            out.extend_from_slice(&u16::try_from(part).unwrap_or(u16::MAX).to_le_bytes());
            out.extend_from_slice(&parts.to_le_bytes());
            out.extend_from_slice(&u16::try_from(chunk.len()).unwrap_or(u16::MAX).to_le_bytes());
            for (key, figures) in *chunk {
                out.extend_from_slice(&key.to_le_bytes());
                out.extend_from_slice(&figures.unanswered.to_le_bytes());
                out.extend_from_slice(&figures.prefill_left_us.to_le_bytes());
                out.extend_from_slice(&figures.in_flight.to_le_bytes());
            }
            out
        })
        .collect()
}

/// The datagram in `bytes`, or `None` for anything else: another protocol, another version,
/// a truncated or padded datagram, parts that do not add up.
pub(crate) fn decode(bytes: &[u8]) -> Option<Datagram> {
    let (header, body) = bytes.split_at_checked(HEADER)?;
    if header[..3] != MAGIC || header[3] != VERSION {
        return None;
    }
    let u16_at = |at: usize| u16::from_le_bytes([header[at], header[at + 1]]);
    let u64_at = |at: usize| u64::from_le_bytes(header[at..at + 8].try_into().unwrap_or_default());
    let (part, parts, count) = (u16_at(20), u16_at(22), usize::from(u16_at(24)));
    if part >= parts || count > ENTRIES_PER_DATAGRAM || body.len() != count * ENTRY {
        return None;
    }
    let entries = body
        .chunks_exact(ENTRY)
        .map(|e| {
            let key = u64::from_le_bytes(e[..8].try_into().unwrap_or_default());
            let unanswered = u32::from_le_bytes(e[8..12].try_into().unwrap_or_default());
            let prefill_left_us = u32::from_le_bytes(e[12..16].try_into().unwrap_or_default());
            let in_flight = u32::from_le_bytes(e[16..20].try_into().unwrap_or_default());
            (key, Figures { unanswered, prefill_left_us, in_flight })
        })
        .collect();
    Some(Datagram { replica: u64_at(4), seq: u64_at(12), part, parts, entries })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(n: u64) -> Vec<(u64, Figures)> {
        (0..n)
            .map(|i| {
                (
                    node_key(&format!("http://10.0.0.{i}:8000")),
                    Figures {
                        unanswered: u32::try_from(i).unwrap(),
                        prefill_left_us: u32::try_from(i * 1000).unwrap(),
                        in_flight: u32::try_from(i * 3).unwrap(),
                    },
                )
            })
            .collect()
    }

    #[test]
    fn a_snapshot_comes_back_as_it_went() {
        let sent = entries(3);
        let datagrams = encode(7, 42, &sent);
        assert_eq!(datagrams.len(), 1);
        assert_eq!(datagrams[0].len(), HEADER + 3 * ENTRY);
        let got = decode(&datagrams[0]).expect("decodes");
        assert_eq!(got, Datagram { replica: 7, seq: 42, part: 0, parts: 1, entries: sent });
    }

    #[test]
    fn many_nodes_are_split_under_the_size_limit() {
        let sent = entries(200);
        let datagrams = encode(1, 2, &sent);
        assert_eq!(datagrams.len(), 4, "58 nodes a datagram");
        assert!(datagrams.iter().all(|d| d.len() <= MAX_DATAGRAM));
        let decoded: Vec<Datagram> = datagrams.iter().map(|d| decode(d).unwrap()).collect();
        assert!(decoded.iter().enumerate().all(|(i, d)| usize::from(d.part) == i && d.parts == 4 && d.seq == 2));
        let back: Vec<(u64, Figures)> = decoded.into_iter().flat_map(|d| d.entries).collect();
        assert_eq!(back, sent);
    }

    #[test]
    fn no_nodes_is_still_one_datagram() {
        let datagrams = encode(1, 1, &[]);
        assert_eq!(datagrams.len(), 1);
        assert_eq!(decode(&datagrams[0]).unwrap().entries, vec![]);
    }

    #[test]
    fn truncated_padded_and_foreign_datagrams_are_refused() {
        let good = encode(1, 1, &entries(2)).remove(0);
        assert!(decode(&good).is_some());
        for cut in 0..good.len() {
            assert_eq!(decode(&good[..cut]), None, "cut at {cut}");
        }
        let mut padded = good.clone();
        padded.push(0);
        assert_eq!(decode(&padded), None);
        let mut other_version = good.clone();
        other_version[3] = VERSION + 1;
        assert_eq!(decode(&other_version), None);
        let mut bad_part = good.clone();
        bad_part[20] = 1; // part 1 of 1
        assert_eq!(decode(&bad_part), None);
        assert_eq!(decode(b"GET / HTTP/1.1\r\nHost: example\r\n\r\n"), None);
        assert_eq!(decode(&[0xff; 600]), None);
    }

    #[test]
    fn node_keys_are_stable() {
        // FNV-1a's published test vector, then a key that must never change between builds.
        assert_eq!(node_key(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(node_key("a"), 0xaf63_dc4c_8601_ec8c);
        assert_ne!(node_key("http://10.0.0.1:8000"), node_key("http://10.0.0.2:8000"));
    }
}
