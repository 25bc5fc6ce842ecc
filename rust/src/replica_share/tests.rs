//! Two shares over real UDP sockets on this host: each stores the other's load in its nodes'
//! counters, and a share that stops is forgotten by the other's own tick.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::{LastSent, OwnLoad, ReplicaShare};
use crate::clock::now_us;
use crate::engine::Engine;
use crate::node::{Node, NodeSpec};

const NODE: &str = "http://127.0.0.1:9001";
const INTERVAL: Duration = Duration::from_millis(10);

fn engine() -> (Arc<Engine>, Arc<Node>) {
    let engine = Engine::for_tests(Duration::from_secs(5));
    let node = engine.registry.add(NODE, NodeSpec::default()).unwrap();
    (engine, node)
}

/// Two shares, A and B, each with the other as its peer, ticking every `interval`; and each
/// one's node. B's address is known once it is bound; A's is told to B after (a peer may come
/// later).
struct Pair {
    a: ReplicaShare,
    b: ReplicaShare,
    node_a: Arc<Node>,
    node_b: Arc<Node>,
    /// Held for the test's length: a share ends with its engine.
    _engines: (Arc<Engine>, Arc<Engine>),
}

fn pair(interval: Duration, runtime: &tokio::runtime::Runtime) -> Pair {
    let (engine_a, node_a) = engine();
    let (engine_b, node_b) = engine();
    let b_probe = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let b_listen = b_probe.local_addr().unwrap().to_string();
    drop(b_probe);
    let start = |engine: &Arc<Engine>, listen: &str, peer: String| {
        ReplicaShare::start(engine, listen, vec![peer], interval, runtime, CancellationToken::new()).unwrap()
    };
    let a = start(&engine_a, "127.0.0.1:0", b_listen.clone());
    let b = start(&engine_b, &b_listen, a.local.to_string());
    Pair { a, b, node_a, node_b, _engines: (engine_a, engine_b) }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap()
}

/// Polls `holds` for up to five seconds.
fn eventually(what: &str, holds: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !holds() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn peers_see_each_others_load_until_one_stops() {
    let runtime = runtime();
    let Pair { a, b, node_a, node_b, _engines } = pair(INTERVAL, &runtime);
    node_a.counters().unanswered.store(2, Ordering::Relaxed);
    node_a.counters().prefill_done_at_us.store(now_us() + 2_000_000, Ordering::Relaxed);
    let b_counters = node_b.counters();
    eventually("B to hear A's two requests", || b_counters.peer_unanswered.load(Ordering::Relaxed) == 2);
    let left = b_counters.peer_prefill_left_ms(now_us());
    assert!(left > 1000.0 && left <= 2000.0, "A's prefill left, by B's clock: {left}");
    assert_eq!(node_a.counters().peer_unanswered.load(Ordering::Relaxed), 0, "B has nothing there");
    assert_eq!(b.stats.live_peers.load(Ordering::Relaxed), 1);
    assert_eq!(b_counters.peer_replicas.load(Ordering::Relaxed), 1, "one other replica routes there");
    assert!(a.stats.sent.load(Ordering::Relaxed) > 0 && b.stats.received.load(Ordering::Relaxed) > 0);
    // A's request answered: B sees it within a few intervals.
    node_a.counters().unanswered.store(0, Ordering::Relaxed);
    eventually("B to see A's requests answered", || b_counters.peer_unanswered.load(Ordering::Relaxed) == 0);
    // A stops while it has a request waiting: B forgets it by its own tick, no datagram needed.
    node_a.counters().unanswered.store(1, Ordering::Relaxed);
    eventually("B to hear the new one", || b_counters.peer_unanswered.load(Ordering::Relaxed) == 1);
    a.stop();
    eventually("B to forget A", || {
        b_counters.peer_unanswered.load(Ordering::Relaxed) == 0 && b.stats.live_peers.load(Ordering::Relaxed) == 0
    });
    assert!(b_counters.peer_prefill_left_ms(now_us()) <= 0.0, "nor its prefill");
    assert_eq!(b_counters.peer_replicas.load(Ordering::Relaxed), 0, "no other replica routes there now");
    assert_eq!(b.stats.malformed.load(Ordering::Relaxed), 0);
}

#[test]
fn a_long_prefill_routed_goes_out_at_once_not_at_the_next_tick() {
    let runtime = runtime();
    // Ticks far apart: what B hears within the test's few seconds, after the first, came on a route.
    let Pair { a: _a, b, node_a, node_b, _engines } = pair(Duration::from_secs(60), &runtime);
    let long = crate::node::load_signal::CLAIM_PREFILL_US;
    // A's first tick (at once) may come before B listens: a long route makes it send again.
    eventually("B to hear A's first snapshot", || {
        crate::node::load_signal::prefill_routed(long);
        b.stats.live_peers.load(Ordering::Relaxed) == 1
    });
    node_a.counters().unanswered.store(3, Ordering::Relaxed);
    crate::node::load_signal::prefill_routed(long);
    eventually("B to hear A's long route long before A's next tick", || {
        node_b.counters().peer_unanswered.load(Ordering::Relaxed) == 3
    });
}

#[test]
fn an_unchanged_load_goes_out_again_only_at_the_heartbeat() {
    let load = vec![OwnLoad { key: 1, unanswered: 2, prefill_done_at_us: 5_000, in_flight: 3 }];
    let hour = Duration::from_secs(3600);
    assert!(LastSent::default().due(&load, hour), "nothing sent yet");
    let sent = LastSent { load: load.clone(), at: Some(Instant::now()) };
    assert!(!sent.due(&load, hour), "the same load, sent just now");
    for change in [
        OwnLoad { unanswered: 1, ..load[0] },
        OwnLoad { prefill_done_at_us: 9_000, ..load[0] },
        OwnLoad { in_flight: 4, ..load[0] },
    ] {
        assert!(sent.due(&[change], hour), "{change:?}");
    }
    assert!(sent.due(&[], hour), "a node gone");
    assert!(sent.due(&load, Duration::ZERO), "the heartbeat due");
}

#[test]
fn an_idle_peer_stays_live_on_its_heartbeat() {
    let runtime = runtime();
    let Pair { a, b, _engines, .. } = pair(INTERVAL, &runtime);
    eventually("B to hear A", || b.stats.live_peers.load(Ordering::Relaxed) == 1);
    let first = a.stats.sent.load(Ordering::Relaxed);
    // Ten times the freshness with nothing changing: A's heartbeats keep it live at B.
    let fresh = super::FRESH_AT_LEAST.max(INTERVAL * super::FRESH_INTERVALS);
    let until = Instant::now() + fresh * 10;
    while Instant::now() < until {
        std::thread::sleep(INTERVAL);
        assert_eq!(b.stats.live_peers.load(Ordering::Relaxed), 1, "A dropped while idle");
    }
    assert!(a.stats.sent.load(Ordering::Relaxed) > first, "heartbeats went out");
}
