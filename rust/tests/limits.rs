//! Property tests: under any interleaving, permits never push a node past its cap and every
//! count returns to zero.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use _pdproxy::ForwardConfig;
use _pdproxy::InFlightPermit;
use _pdproxy::Outcome;
use _pdproxy::Registry;
use _pdproxy::{policy_from_spec, PolicySpec, SelectCtx, POLICY_NAMES};
use _pdproxy::{select, Engine, EngineConfig, RolePolicies};
use _pdproxy::{Node, NodeSpec, NodeState};
use proptest::prelude::*;

fn capped_nodes(caps: &[u32]) -> (Registry, Vec<Arc<Node>>) {
    let reg = Registry::new();
    let nodes = caps
        .iter()
        .enumerate()
        .map(|(i, &cap)| {
            let spec = NodeSpec { models: vec!["m".into()], max_concurrency: Some(cap), ..NodeSpec::default() };
            reg.add(&format!("h:{i}"), spec).unwrap()
        })
        .collect();
    (reg, nodes)
}

#[derive(Debug, Clone)]
enum Op {
    Acquire(usize),
    Release(usize),
    SetCap(usize, u32),
    SetState(usize, bool),
}

fn op(nodes: usize) -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..nodes).prop_map(Op::Acquire),
        3 => (0..64usize).prop_map(Op::Release),
        1 => (0..nodes, 1..4u32).prop_map(|(n, c)| Op::SetCap(n, c)),
        1 => (0..nodes, any::<bool>()).prop_map(|(n, h)| Op::SetState(n, h)),
    ]
}

proptest! {
    #[test]
    fn sequential_interleavings_respect_caps(ops in prop::collection::vec(op(3), 1..200)) {
        let (_reg, nodes) = capped_nodes(&[1, 2, 3]);
        let mut held: Vec<InFlightPermit> = Vec::new();
        let mut taken = 0u64;
        for op in ops {
            match op {
                Op::Acquire(n) => {
                    let before = nodes[n].counters().in_flight();
                    let cap = u64::from(nodes[n].counters().max_concurrency().unwrap());
                    match InFlightPermit::try_acquire(&nodes[n], None) {
                        Some(p) => {
                            prop_assert!(before < cap, "acquired at {before} with cap {cap}");
                            held.push(p);
                            taken += 1;
                        }
                        None => prop_assert!(before >= cap),
                    }
                }
                Op::Release(k) if !held.is_empty() => {
                    let mut p = held.swap_remove(k % held.len());
                    p.set_outcome(if k % 2 == 0 { Outcome::Succeeded } else { Outcome::Failed });
                }
                Op::Release(_) => {}
                Op::SetCap(n, c) => nodes[n].counters().set_max_concurrency(Some(c)),
                Op::SetState(n, healthy) => nodes[n].counters().set_state(if healthy { NodeState::Healthy } else { NodeState::Unhealthy }),
            }
        }
        drop(held);
        let requests: u64 = nodes.iter().map(|n| n.counters().snapshot().requests).sum();
        prop_assert_eq!(requests, taken);
        for n in &nodes {
            let s = n.counters().snapshot();
            prop_assert_eq!(s.in_flight, 0);
            prop_assert_eq!(s.succeeded + s.failed + s.cancelled, s.requests);
        }
    }
}

/// Threads race to select through every policy; a node's in-flight count, read right after
/// each acquisition, never exceeds its cap, and everything returns to zero.
#[test]
fn concurrent_selection_never_exceeds_caps() {
    for name in POLICY_NAMES {
        let (reg, nodes) = capped_nodes(&[1, 2, 3]);
        let reg = Arc::new(reg);
        let policy = policy_from_spec(&PolicySpec::for_tests(name).unwrap(), 10_000);
        let violations = Arc::new(AtomicU64::new(0));
        let admitted = Arc::new(AtomicU64::new(0));
        std::thread::scope(|scope| {
            for t in 0..8 {
                let (reg, policy, violations, admitted) = (&reg, &policy, &violations, &admitted);
                scope.spawn(move || {
                    let key = format!("user-{t}");
                    for i in 0..2_000 {
                        let ctx = SelectCtx {
                            model: Some("m"),
                            affinity: Some(&key),
                            prompt: Some(b"[1,2,3]"),
                            ..SelectCtx::default()
                        };
                        if let Ok(permit) = select(&reg.load(), &ctx, policy.as_ref(), None) {
                            admitted.fetch_add(1, Ordering::Relaxed);
                            let c = permit.node().counters();
                            if c.in_flight() > u64::from(c.max_concurrency().unwrap()) {
                                violations.fetch_add(1, Ordering::Relaxed);
                            }
                            if i % 7 == 0 {
                                std::thread::yield_now();
                            }
                        }
                    }
                });
            }
        });
        assert_eq!(violations.load(Ordering::Relaxed), 0, "{name}");
        assert!(admitted.load(Ordering::Relaxed) > 0, "{name}");
        for n in &nodes {
            assert_eq!(n.counters().in_flight(), 0, "{name}");
        }
    }
}

/// Many requests through a tiny cap and the engine's FIFO queue: the cap holds, every request
/// is served, and the queue and counts end empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn queued_requests_are_all_served_within_the_cap() {
    let config = EngineConfig {
        policies: RolePolicies::every_role(PolicySpec::LeastRequests),
        engine_max_age_ms: 10_000,
        queue_size: 1000,
        queue_timeout: Duration::from_secs(5),
        request_timeout: None,
        retries: 0,
        retry_budget_ratio: 0.2,
        retry_budget_floor: 10,
        circuit_failures: 0,
        circuit_cooldown: Duration::from_secs(1),
        forward: ForwardConfig {
            connect_timeout: Duration::from_secs(1),
            first_byte_timeout: Duration::from_secs(1),
            pool_idle_timeout: Duration::from_secs(1),
            pool_max_idle_per_node: 1,
            prefetch_limit: 0,
            stream_idle_timeout: Duration::from_secs(1),
            stream_buffer_limit: 1 << 20,
            stream_stall_timeout: Duration::from_secs(1),
            node_ca_file: None,
            tcp_keepalive: Duration::from_secs(60),
            answer_buffer_limit: 1 << 20,
            answer_timeout: Duration::from_secs(1),
        },
        max_requests: 0,
        max_n: 128,
        tracing: None,
    };
    let engine = Arc::new(Engine::new(config, Registry::new()));
    let spec = NodeSpec { models: vec!["m".into()], max_concurrency: Some(2), ..NodeSpec::default() };
    let node = engine.add_node("h:1", spec).unwrap();
    let peak = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for i in 0..200u64 {
        let (engine, peak) = (Arc::clone(&engine), Arc::clone(&peak));
        tasks.push(tokio::spawn(async move {
            let ctx = SelectCtx { model: Some("m"), ..SelectCtx::default() };
            let permit = engine.permit(&ctx).await.expect("served within the queue timeout");
            peak.fetch_max(permit.node().counters().in_flight(), Ordering::Relaxed);
            tokio::time::sleep(Duration::from_micros(200 + (i % 5) * 100)).await;
            drop(permit);
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert!(peak.load(Ordering::Relaxed) <= 2);
    assert_eq!(node.counters().in_flight(), 0);
    assert_eq!(node.counters().snapshot().requests, 200);
    assert_eq!(engine.admission.queued(), 0);
    assert_eq!(engine.registry.model_requests(), [("m".to_owned(), 200)]);
}
