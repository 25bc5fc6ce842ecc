//! Replicas of pdproxy in front of the same engines tell each other their own load on every
//! node, so that each prices a node by all the prefill work waiting there, not only its own
//! share of it (with four replicas, each saw a quarter, and sent new prompts to engines busy
//! with the others').
//!
//! Every interval where they changed (or went unsent for a quarter of the peers' freshness:
//! the heartbeat) one task sends each peer (UDP, `wire`) this replica's own figures per node:
//! the requests it sent there still waiting for their first byte, the prefill it expects the
//! node to still owe them (time left, so no clock is shared between hosts), and its requests
//! there not yet ended. Figures received are never sent on, so nothing is counted twice. The
//! same task receives the peers' datagrams, keeps each peer's latest snapshot (`peers`), and
//! stores the live peers' sums in each node's `peer_unanswered`, `peer_prefill_done_at_us` and
//! `peer_in_flight`, and their number in `peer_replicas`: the request path only reads a few more
//! atomics. Besides every interval, a
//! snapshot goes out at once when this replica routes a long prefill (`load_signal`, a fresh
//! prompt of at least `CLAIM_PREFILL_US`): between two intervals the replicas see the same
//! figures, and two of them routing new conversations' first turns within one interval sent
//! them to the same engine. On `bench/fleet.py`'s `multi_turn` (four replicas against one, seeds
//! 1-2, bench/results/2026-12-07-0233-fleet-replicas-first-turns.md) the first turns' TTFT p99
//! went from 145-148 ms to 129-131 (one replica: 95-104), the whole run's from 1.05-1.11x one
//! replica's to 0.95-1.06x; over seeds 1-6, 0.90-1.12x (median 1.06x). (A snapshot on every
//! change, at most one a millisecond, had not helped: 1.03-1.17x.) A peer that stops sending
//! stops counting after `FRESH_INTERVALS` intervals (`FRESH_AT_LEAST`), checked on
//! every tick, not only when a datagram comes.

mod peers;
mod wire;

use std::net::{SocketAddr, ToSocketAddrs, UdpSocket as StdUdpSocket};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use tokio::net::UdpSocket;
use tokio_util::sync::CancellationToken;

use crate::clock::now_us;
use crate::engine::Engine;
use crate::error::{Error, Kind, Result};
use crate::node::load_signal::{self, Running};
use crate::node::Node;
use peers::PeerTable;
use wire::{decode, encode, node_key, Figures, MAX_DATAGRAM};

/// A peer counts while its last snapshot is younger than this many intervals: a lost
/// datagram or two do not drop it, a stopped peer is gone within a tenth of a second.
const FRESH_INTERVALS: u32 = 5;
/// And never less than this: short intervals would otherwise drop a live peer whose datagrams a
/// busy host delays by a few milliseconds.
const FRESH_AT_LEAST: Duration = Duration::from_millis(50);
/// How often the peers' names are resolved again (one may move).
const RESOLVE_EVERY: Duration = Duration::from_secs(10);
/// A snapshot unchanged since the last sent goes out again only after this share of the
/// peers' freshness: enough to stay live through two lost datagrams.
const HEARTBEAT_SHARE: u32 = 4;

/// What the task did, for `/metrics`.
#[derive(Debug, Default)]
pub(crate) struct ShareStats {
    pub(crate) sent: AtomicU64,
    pub(crate) received: AtomicU64,
    pub(crate) malformed: AtomicU64,
    pub(crate) live_peers: AtomicU64,
}

/// The running share: stops when dropped or stopped.
pub(crate) struct ReplicaShare {
    pub(crate) stats: Arc<ShareStats>,
    /// The address it listens on (the port chosen, when asked for 0).
    pub(crate) local: SocketAddr,
    stop: CancellationToken,
}

impl ReplicaShare {
    /// Binds `listen` (`HOST:PORT`) now, then shares `engine`'s nodes' load with `peers`
    /// (`HOST:PORT` each) every `interval`, on `runtime`, until `stop` is cancelled.
    pub(crate) fn start(
        engine: &Arc<Engine>,
        listen: &str,
        peers: Vec<String>,
        interval: Duration,
        runtime: &tokio::runtime::Runtime,
        stop: CancellationToken,
    ) -> Result<Self> {
        let socket = bind(listen)?;
        let local = socket.local_addr().map_err(|e| Error::with_source(Kind::Config, "replica_listen", e))?;
        let socket = {
            let _entered = runtime.enter();
            UdpSocket::from_std(socket).map_err(|e| Error::with_source(Kind::Config, "replica_listen", e))?
        };
        let stats = Arc::new(ShareStats::default());
        let task = Task {
            engine: Arc::downgrade(engine),
            socket,
            peers: peers.into_iter().map(|name| Peer { name, address: None }).collect(),
            interval,
            stats: Arc::clone(&stats),
            me: fastrand::u64(..),
            last_sent: LastSent::default(),
        };
        runtime.spawn(task.run(stop.clone()));
        Ok(Self { stats, local, stop })
    }

    pub(crate) fn stop(&self) {
        self.stop.cancel();
    }
}

impl Drop for ReplicaShare {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn bind(listen: &str) -> Result<StdUdpSocket> {
    let address = listen
        .to_socket_addrs()
        .map_err(|e| Error::with_source(Kind::Config, format!("replica_listen: cannot resolve {listen}"), e))?
        .next()
        .ok_or_else(|| Error::new(Kind::Config, format!("replica_listen: {listen} resolves to no address")))?;
    let socket = StdUdpSocket::bind(address)
        .map_err(|e| Error::new(Kind::Config, format!("replica_listen: cannot listen on {address}: {e}")))?;
    socket
        .set_nonblocking(true)
        .map_err(|e| Error::new(Kind::Config, format!("replica_listen: cannot listen on {address}: {e}")))?;
    Ok(socket)
}

/// A peer as configured, and where its name last resolved.
struct Peer {
    name: String,
    address: Option<SocketAddr>,
}

struct Task {
    engine: Weak<Engine>,
    socket: UdpSocket,
    peers: Vec<Peer>,
    interval: Duration,
    stats: Arc<ShareStats>,
    /// This replica's id in its datagrams: random at each start, so a restarted replica is a
    /// new peer and its sequence numbers start over safely.
    me: u64,
    last_sent: LastSent,
}

/// This replica's own load on one node as it stands, its prefill as due by this host's clock
/// (0: none owed): unlike the figures sent (time left), it changes only when the load does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct OwnLoad {
    key: u64,
    unanswered: u64,
    prefill_done_at_us: u64,
    in_flight: u64,
}

/// What this replica last sent, and when: a tick whose load is the same sends nothing until the
/// heartbeat is due. (Every tick sending cost an idle replica as much as the rest of its work:
/// waking, and waking each peer, 200 times a second.)
#[derive(Debug, Default)]
struct LastSent {
    load: Vec<OwnLoad>,
    at: Option<Instant>,
}

impl LastSent {
    fn due(&self, load: &[OwnLoad], heartbeat: Duration) -> bool {
        self.load != load || self.at.is_none_or(|at| at.elapsed() >= heartbeat)
    }
}

impl Task {
    async fn run(mut self, stop: CancellationToken) {
        let fresh = (self.interval * FRESH_INTERVALS).max(FRESH_AT_LEAST);
        let fresh_for = u64::try_from(fresh.as_micros()).unwrap_or(u64::MAX);
        let heartbeat = fresh / HEARTBEAT_SHARE;
        let mut table = PeerTable::new(self.me, fresh_for);
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut resolved_at: Option<Instant> = None;
        let mut seq = 0u64;
        let mut buf = vec![0u8; MAX_DATAGRAM * 2];
        let _running = Running::new();
        // Registered before each wait, so a route while a snapshot goes out is not missed.
        let routed = load_signal::routed();
        tokio::pin!(routed);
        routed.as_mut().enable();
        loop {
            tokio::select! {
                () = stop.cancelled() => break,
                () = &mut routed => {
                    routed.set(load_signal::routed());
                    routed.as_mut().enable();
                    let Some(engine) = self.engine.upgrade() else { break };
                    seq += 1;
                    self.send(own_load(&engine, now_us()), seq).await;
                }
                _ = tick.tick() => {
                    let Some(engine) = self.engine.upgrade() else { break };
                    if resolved_at.is_none_or(|at| at.elapsed() >= RESOLVE_EVERY) {
                        self.resolve().await;
                        resolved_at = Some(Instant::now());
                    }
                    let load = own_load(&engine, now_us());
                    if self.last_sent.due(&load, heartbeat) {
                        seq += 1;
                        self.send(load, seq).await;
                    }
                    let now = now_us();
                    table.expire(now);
                    self.apply(&engine, &table, now);
                }
                received = self.socket.recv_from(&mut buf) => {
                    // An error here is the kernel's word on an earlier datagram (a peer's port
                    // closed): nothing to do but carry on.
                    let Ok((len, _from)) = received else { continue };
                    let Some(datagram) = decode(&buf[..len]) else {
                        self.stats.malformed.fetch_add(1, Ordering::Relaxed);
                        continue;
                    };
                    self.stats.received.fetch_add(1, Ordering::Relaxed);
                    let now = now_us();
                    if table.accept(datagram, now) {
                        let Some(engine) = self.engine.upgrade() else { break };
                        self.apply(&engine, &table, now);
                    }
                }
            }
        }
        // Stopped: the peers' load must not outlive the share.
        if let Some(engine) = self.engine.upgrade() {
            self.apply(&engine, &PeerTable::new(self.me, 0), now_us());
        }
    }

    /// Resolves each peer's name (a name that does not resolve now keeps its last address).
    async fn resolve(&mut self) {
        for peer in &mut self.peers {
            if let Ok(mut addresses) = tokio::net::lookup_host(peer.name.as_str()).await {
                peer.address = addresses.next().or(peer.address);
            }
        }
    }

    /// Sends every peer this replica's own load (never what it heard from the others).
    async fn send(&mut self, load: Vec<OwnLoad>, seq: u64) {
        let now = now_us();
        let figures: Vec<(u64, Figures)> = load.iter().map(|l| l.figures(now)).collect();
        let datagrams = encode(self.me, seq, &figures);
        self.last_sent = LastSent { load, at: Some(Instant::now()) };
        for address in self.peers.iter().filter_map(|p| p.address) {
            for datagram in &datagrams {
                if self.socket.send_to(datagram, address).await.is_ok() {
                    self.stats.sent.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// Stores the live peers' sums in every node's counters.
    fn apply(&self, engine: &Engine, table: &PeerTable, now: u64) {
        let sums = table.sums(now);
        let live = table.live(now) as u64;
        for node in engine.registry.load().nodes() {
            let load = sums.get(&node_key(node.url())).copied().unwrap_or_default();
            let counters = node.counters();
            counters.peer_unanswered.store(load.unanswered, Ordering::Relaxed);
            counters.peer_in_flight.store(load.in_flight, Ordering::Relaxed);
            let done_at = if load.prefill_left_us > 0 { now + load.prefill_left_us } else { 0 };
            counters.peer_prefill_done_at_us.store(done_at, Ordering::Relaxed);
            counters.peer_replicas.store(live, Ordering::Relaxed);
        }
        self.stats.live_peers.store(live, Ordering::Relaxed);
    }
}

/// This replica's own load on every node of `engine`, at `now_us`.
fn own_load(engine: &Engine, now_us: u64) -> Vec<OwnLoad> {
    engine.registry.load().nodes().iter().map(|node| OwnLoad::of(node, now_us)).collect()
}

impl OwnLoad {
    fn of(node: &Node, now_us: u64) -> Self {
        let counters = node.counters();
        let due = counters.prefill_done_at_us.load(Ordering::Relaxed);
        Self {
            key: node_key(node.url()),
            unanswered: counters.unanswered.load(Ordering::Relaxed),
            prefill_done_at_us: if due > now_us { due } else { 0 },
            in_flight: counters.in_flight(),
        }
    }

    /// As sent at `now_us`: the prefill as time left.
    fn figures(&self, now_us: u64) -> (u64, Figures) {
        let left = self.prefill_done_at_us.saturating_sub(now_us);
        (
            self.key,
            Figures {
                unanswered: u32::try_from(self.unanswered).unwrap_or(u32::MAX),
                prefill_left_us: u32::try_from(left).unwrap_or(u32::MAX),
                in_flight: u32::try_from(self.in_flight).unwrap_or(u32::MAX),
            },
        )
    }
}

#[cfg(test)]
mod tests;
