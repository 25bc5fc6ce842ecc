//! What the other replicas last said of their load, and its sum per node over those still
//! alive: a replica that stops sending is forgotten once its last snapshot is too old, so its
//! load does not linger on the nodes after it died or was cut off.

use std::collections::HashMap;

use super::wire::{Datagram, Figures};

/// The peers' load on one node, summed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct PeerLoad {
    pub(crate) unanswered: u64,
    /// The prefill they expect the node to still owe them, microseconds from now, summed.
    pub(crate) prefill_left_us: u64,
    pub(crate) in_flight: u64,
}

/// A figure as received: `prefill_done_at_us` by this host's clock (arrival + time left).
#[derive(Debug, Clone, Copy)]
struct Held {
    unanswered: u32,
    prefill_done_at_us: u64,
    in_flight: u32,
}

/// A snapshot whose datagrams are still arriving.
#[derive(Debug, Default)]
struct Pending {
    seq: u64,
    parts: u16,
    seen: Vec<bool>,
    figures: HashMap<u64, Held>,
}

#[derive(Debug, Default)]
struct Peer {
    /// The last whole snapshot: its sequence number, when it came, and its figures by node key.
    seq: u64,
    arrived_us: Option<u64>,
    figures: HashMap<u64, Held>,
    pending: Option<Pending>,
    /// When anything of it last came (a peer heard of only in parts is dropped too).
    heard_us: u64,
}

/// The peers' snapshots, by replica id.
#[derive(Debug)]
pub(crate) struct PeerTable {
    me: u64,
    /// How old a peer's last whole snapshot may be for its figures to count.
    fresh_for_us: u64,
    peers: HashMap<u64, Peer>,
}

impl PeerTable {
    pub(crate) fn new(me: u64, fresh_for_us: u64) -> Self {
        Self { me, fresh_for_us, peers: HashMap::new() }
    }

    /// Takes in a datagram that came at `now_us`; true when it completed a newer snapshot (the
    /// sums changed). This replica's own datagrams (listed among its peers) and older
    /// snapshots' are ignored.
    pub(crate) fn accept(&mut self, datagram: Datagram, now_us: u64) -> bool {
        if datagram.replica == self.me {
            return false;
        }
        let peer = self.peers.entry(datagram.replica).or_default();
        if peer.arrived_us.is_some() && datagram.seq <= peer.seq {
            return false;
        }
        peer.heard_us = now_us;
        let pending = match &mut peer.pending {
            Some(p) if p.seq > datagram.seq => return false,
            Some(p) if p.seq == datagram.seq => p,
            slot => slot.insert(Pending {
                seq: datagram.seq,
                parts: datagram.parts,
                seen: vec![false; usize::from(datagram.parts)],
                figures: HashMap::new(),
            }),
        };
        if pending.parts != datagram.parts {
            return false;
        }
        pending.seen[usize::from(datagram.part)] = true;
        for (key, Figures { unanswered, prefill_left_us, in_flight }) in datagram.entries {
            let held = Held { unanswered, prefill_done_at_us: now_us + u64::from(prefill_left_us), in_flight };
            pending.figures.insert(key, held);
        }
        if !pending.seen.iter().all(|&seen| seen) {
            return false;
        }
        let whole = peer.pending.take().unwrap_or_default();
        peer.seq = whole.seq;
        peer.figures = whole.figures;
        peer.arrived_us = Some(now_us);
        true
    }

    /// Forgets the peers not heard from lately (their figures stopped counting already, see
    /// `live`); returns how many.
    pub(crate) fn expire(&mut self, now_us: u64) -> usize {
        let (before, fresh_for) = (self.peers.len(), self.fresh_for_us);
        self.peers.retain(|_, peer| now_us.saturating_sub(peer.heard_us) <= fresh_for);
        before - self.peers.len()
    }

    /// Peers whose last whole snapshot is fresh.
    pub(crate) fn live(&self, now_us: u64) -> usize {
        self.live_peers(now_us).count()
    }

    fn live_peers(&self, now_us: u64) -> impl Iterator<Item = &Peer> {
        self.peers
            .values()
            .filter(move |p| p.arrived_us.is_some_and(|at| now_us.saturating_sub(at) <= self.fresh_for_us))
    }

    /// The live peers' load per node key, at `now_us`.
    pub(crate) fn sums(&self, now_us: u64) -> HashMap<u64, PeerLoad> {
        let mut sums: HashMap<u64, PeerLoad> = HashMap::new();
        for (key, held) in self.live_peers(now_us).flat_map(|p| &p.figures) {
            let sum = sums.entry(*key).or_default();
            sum.unanswered += u64::from(held.unanswered);
            sum.prefill_left_us += held.prefill_done_at_us.saturating_sub(now_us);
            sum.in_flight += u64::from(held.in_flight);
        }
        sums
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replica_share::wire::{decode, encode};

    const FRESH: u64 = 100_000;

    fn datagram(replica: u64, seq: u64, figures: &[(u64, u32, u32)]) -> Datagram {
        let entries: Vec<(u64, Figures)> = figures
            .iter()
            .map(|&(k, u, l)| (k, Figures { unanswered: u, prefill_left_us: l, in_flight: u + 1 }))
            .collect();
        decode(&encode(replica, seq, &entries)[0]).unwrap()
    }

    #[test]
    fn peers_add_up_per_node() {
        let mut table = PeerTable::new(1, FRESH);
        assert!(table.accept(datagram(2, 1, &[(10, 2, 5_000), (20, 1, 0)]), 1_000_000));
        assert!(table.accept(datagram(3, 1, &[(10, 1, 3_000)]), 1_000_000));
        let sums = table.sums(1_001_000);
        assert_eq!(sums[&10], PeerLoad { unanswered: 3, prefill_left_us: 4_000 + 2_000, in_flight: 5 });
        assert_eq!(sums[&20], PeerLoad { unanswered: 1, prefill_left_us: 0, in_flight: 2 });
        assert_eq!(table.live(1_001_000), 2);
    }

    #[test]
    fn a_newer_snapshot_replaces_the_last_and_an_older_one_is_ignored() {
        let mut table = PeerTable::new(1, FRESH);
        assert!(table.accept(datagram(2, 5, &[(10, 4, 0)]), 0));
        assert!(table.accept(datagram(2, 6, &[(20, 1, 0)]), 10));
        assert!(!table.accept(datagram(2, 4, &[(10, 9, 0)]), 20), "reordered: older");
        let sums = table.sums(20);
        assert_eq!((sums.get(&10), sums[&20].unanswered), (None, 1), "not counted twice, nor kept");
    }

    #[test]
    fn its_own_datagrams_are_not_counted() {
        let mut table = PeerTable::new(1, FRESH);
        assert!(!table.accept(datagram(1, 1, &[(10, 4, 0)]), 0));
        assert!(table.sums(0).is_empty());
    }

    #[test]
    fn a_split_snapshot_counts_once_whole() {
        let entries: Vec<(u64, Figures)> =
            (0..100).map(|k| (k, Figures { unanswered: 1, prefill_left_us: 0, in_flight: 1 })).collect();
        let parts: Vec<Datagram> = encode(2, 1, &entries).iter().map(|d| decode(d).unwrap()).collect();
        assert_eq!(parts.len(), 2);
        let mut table = PeerTable::new(1, FRESH);
        assert!(!table.accept(parts[1].clone(), 0), "half a snapshot");
        assert!(table.sums(0).is_empty());
        assert!(table.accept(parts[0].clone(), 0));
        assert_eq!(table.sums(0).len(), 100);
    }

    #[test]
    fn a_silent_peer_stops_counting_then_is_forgotten() {
        let mut table = PeerTable::new(1, FRESH);
        table.accept(datagram(2, 1, &[(10, 2, 500_000)]), 0);
        table.accept(datagram(3, 1, &[(10, 1, 0)]), 60_000);
        assert_eq!(table.sums(FRESH)[&10].unanswered, 3);
        // Past the freshness of peer 2's snapshot: only peer 3 counts, even before expiry.
        assert_eq!(table.sums(FRESH + 1)[&10], PeerLoad { unanswered: 1, prefill_left_us: 0, in_flight: 2 });
        assert_eq!(table.expire(FRESH + 1), 1, "peer 2 went");
        assert_eq!(table.live(FRESH + 1), 1);
        assert_eq!(table.expire(FRESH + 2), 0, "nothing more to forget");
        assert_eq!(table.expire(60_000 + FRESH + 1), 1);
        assert!(table.sums(60_000 + FRESH + 1).is_empty());
    }

    #[test]
    fn time_left_runs_down_and_stops_at_zero() {
        let mut table = PeerTable::new(1, FRESH);
        table.accept(datagram(2, 1, &[(10, 1, 30_000)]), 0);
        assert_eq!(table.sums(10_000)[&10].prefill_left_us, 20_000);
        assert_eq!(table.sums(40_000)[&10].prefill_left_us, 0);
    }
}
