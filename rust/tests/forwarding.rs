//! The forwarder against a real upstream socket: bytes, batches, errors and accounting.

mod common;

use std::sync::Arc;
use std::time::Duration;

use _pdproxy::Error;
use _pdproxy::ForwardRequest;
use _pdproxy::Outcome;
use _pdproxy::Registry;
use _pdproxy::RetryBudget;
use _pdproxy::{pump, Delivery, Exchange, StreamTimeouts};
use _pdproxy::{ForwardConfig, Forwarder, ResponseBody, StreamBody, UpstreamResponse};
use _pdproxy::{Node, NodeSpec};
use http::Method;

fn forwarder(first_byte_timeout: Duration) -> Forwarder {
    Forwarder::new(
        ForwardConfig {
            connect_timeout: Duration::from_secs(2),
            first_byte_timeout,
            pool_idle_timeout: Duration::from_secs(30),
            pool_max_idle_per_node: 8,
            prefetch_limit: 1 << 20,
            stream_idle_timeout: Duration::from_secs(5),
            stream_buffer_limit: 1 << 20,
            stream_stall_timeout: Duration::from_secs(5),
            node_ca_file: None,
            tcp_keepalive: Duration::from_secs(60),
            answer_buffer_limit: 1 << 20,
            answer_timeout: Duration::from_secs(5),
        },
        "pdproxy-test",
        Arc::new(RetryBudget::new(0.2, 10)),
    )
}

fn node(addr: &str) -> Arc<Node> {
    Registry::new().add(addr, NodeSpec::default()).unwrap()
}

async fn send(fwd: &Forwarder, node: &Arc<Node>, path: &str) -> _pdproxy::Result<UpstreamResponse> {
    let request = ForwardRequest {
        method: Method::POST,
        path_and_query: path.to_owned(),
        headers: _pdproxy::header_map(&[(b"content-type".to_vec(), b"application/json".to_vec())]),
        extra: Vec::new(),
        body: bytes::Bytes::from_static(b"{}"),
    };
    fwd.forward(node, &request, true, None).await
}

/// Pumps `stream` and reads it as the Python side does: batches until the end or an error.
async fn read_all(stream: StreamBody) -> (Vec<bytes::Bytes>, Option<Error>) {
    let exchange = Arc::new(Exchange::new(1 << 20));
    let pumping = Arc::clone(&exchange);
    tokio::spawn(async move {
        let timeouts = StreamTimeouts { idle: Duration::from_secs(5), stall: Duration::from_secs(5) };
        pump(&pumping, stream, std::time::Instant::now(), timeouts, Outcome::Succeeded, &mut |_, _| {}).await;
    });
    let mut batches = Vec::new();
    loop {
        let delivery = if let Some(d) = exchange.take_ready() {
            d
        } else {
            let (tx, rx) = tokio::sync::oneshot::channel();
            match exchange.wait(Box::new(move |d| drop(tx.send(d)))) {
                Ok(()) => rx.await.unwrap(),
                Err((d, _)) => d,
            }
        };
        match delivery {
            Delivery::Batch(b) => batches.push(b),
            Delivery::End => return (batches, None),
            Delivery::Failed(e) => return (batches, Some(e)),
        }
    }
}

#[tokio::test]
async fn fragmented_sse_arrives_byte_for_byte_in_whole_events() {
    let addr = common::upstream().await;
    let node = node(&addr.to_string());
    let fwd = forwarder(Duration::from_secs(5));
    for _ in 0..3 {
        let response = send(&fwd, &node, "/sse").await.unwrap();
        assert_eq!(response.status, 200);
        let ResponseBody::Streaming(body) = response.body else { panic!("an event stream must stream") };
        let (batches, error) = read_all(body).await;
        assert!(error.is_none(), "{error:?}");
        let mut received = Vec::new();
        for batch in batches {
            assert!(batch.ends_with(b"\n\n"), "batch cut inside an event: {batch:?}");
            received.extend_from_slice(&batch);
        }
        assert_eq!(received, common::sse_body(200));
    }
}

#[tokio::test]
async fn small_json_is_read_before_the_head_is_handed_over() {
    let addr = common::upstream().await;
    let node = node(&addr.to_string());
    let response = send(&forwarder(Duration::from_secs(5)), &node, "/json").await.unwrap();
    let ResponseBody::Complete(body) = response.body else { panic!("small JSON must be prefetched") };
    assert_eq!(body, r#"{"ok":true}"#);
}

#[tokio::test]
async fn upstream_errors_pass_through_and_count_as_failures() {
    use _pdproxy::Outcome;
    let addr = common::upstream().await;
    let node = node(&addr.to_string());
    let response = send(&forwarder(Duration::from_secs(5)), &node, "/error").await.unwrap();
    assert_eq!(response.status, 503);
    assert_eq!(response.outcome(), Outcome::Failed, "a gateway error counts against the node");
    let ResponseBody::Complete(body) = response.body else { panic!() };
    assert_eq!(body, r#"{"error":{"message":"busy"}}"#);
}

#[tokio::test]
async fn torn_stream_reports_an_upstream_error() {
    let addr = common::upstream().await;
    let node = node(&addr.to_string());
    let response = send(&forwarder(Duration::from_secs(5)), &node, "/sse-torn").await.unwrap();
    let ResponseBody::Streaming(body) = response.body else { panic!() };
    let (batches, error) = read_all(body).await;
    assert!(batches.iter().all(|b| b.ends_with(b"\n\n")));
    assert!(error.expect("a torn stream must not end cleanly").is_upstream());
}

#[tokio::test]
async fn a_pinned_node_is_reached_at_its_checked_address_not_by_resolving_its_name() {
    let addr = common::upstream().await;
    let spec = NodeSpec { address: Some(addr), ..NodeSpec::default() };
    // The name does not resolve (`.invalid` never does): only the pinned address can serve.
    let pinned = Registry::new().add(&format!("unresolvable.invalid:{}", addr.port()), spec).unwrap();
    let response = send(&forwarder(Duration::from_secs(5)), &pinned, "/json").await.unwrap();
    assert_eq!(response.status, 200);
    let unpinned = node(&format!("unresolvable.invalid:{}", addr.port()));
    let err = send(&forwarder(Duration::from_secs(5)), &unpinned, "/json").await.unwrap_err();
    assert!(err.is_connect(), "{err:?}");
}

#[tokio::test]
async fn connect_failure_and_timeout_have_their_kinds() {
    // Bind then drop a listener: nothing listens on that port now.
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let dead = node(&free.to_string());
    let err = send(&forwarder(Duration::from_secs(5)), &dead, "/json").await.unwrap_err();
    assert!(err.is_connect(), "{err:?}");

    let addr = common::upstream().await;
    let slow = node(&addr.to_string());
    let err = send(&forwarder(Duration::from_millis(100)), &slow, "/hang").await.unwrap_err();
    assert!(err.is_timeout(), "{err:?}");
}
