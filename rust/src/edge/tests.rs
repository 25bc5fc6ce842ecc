//! The pipeline and its strategies against fake nodes on real sockets: what each node receives
//! and what the client gets, for Hybrid and each prefill/decode protocol, and the relay's
//! timers. The fake node speaks raw HTTP/1.1 and answers one request per connection.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

use super::body::EdgeBody;
use super::request::BodyError;
use super::{EdgeConfig, Embedded, PdProtocol};
use crate::distserve::{DistServe, DistServeConfig, LinkMaker};
use crate::engine::Engine;
use crate::error::Result;
use crate::node::{NodeSpec, NodeState, Role};

/// What a fake node answers: raw bytes after the request, written in pieces with a pause
/// before each.
type Answer = Vec<(Duration, Vec<u8>)>;

/// A node that records every request (path, body) and answers by path.
struct FakeNode {
    url: String,
    seen: Arc<Mutex<Vec<(String, serde_json::Value)>>>,
}

impl FakeNode {
    async fn start(answer: impl Fn(&str, &serde_json::Value) -> Answer + Send + Sync + 'static) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (answer, log) = (Arc::new(answer), Arc::clone(&seen));
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let (answer, log) = (Arc::clone(&answer), Arc::clone(&log));
                tokio::spawn(async move {
                    let Some((path, body)) = read_request(&mut socket).await else { return };
                    let json = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
                    log.lock().unwrap().push((path.clone(), json.clone()));
                    for (pause, bytes) in answer(&path, &json) {
                        tokio::time::sleep(pause).await;
                        if socket.write_all(&bytes).await.is_err() {
                            return;
                        }
                    }
                    let _ = socket.shutdown().await;
                });
            }
        });
        Self { url, seen }
    }

    fn seen(&self) -> Vec<(String, serde_json::Value)> {
        self.seen.lock().unwrap().clone()
    }
}

async fn read_request(socket: &mut tokio::net::TcpStream) -> Option<(String, Vec<u8>)> {
    let mut buffer = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        let n = socket.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buffer.extend_from_slice(&chunk[..n]);
        if let Some(end) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
            break end + 4;
        }
    };
    let head = String::from_utf8_lossy(&buffer[..head_end]).to_lowercase();
    let path = head.split(' ').nth(1)?.to_owned();
    let length: usize =
        head.lines().find_map(|line| line.strip_prefix("content-length:")).map_or(0, |n| n.trim().parse().unwrap_or(0));
    while buffer.len() < head_end + length {
        let n = socket.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buffer.extend_from_slice(&chunk[..n]);
    }
    Some((path, buffer[head_end..head_end + length].to_vec()))
}

fn json_answer(status: u16, body: &serde_json::Value) -> Answer {
    let body = body.to_string();
    let head = format!(
        "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    vec![(Duration::ZERO, [head.into_bytes(), body.into_bytes()].concat())]
}

/// An event stream: its head, then each event after `gap` (`stall`: a last pause, then the end).
fn stream_answer(events: &[&str], gap: Duration, stall: Duration) -> Answer {
    let head =
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n";
    let mut out = vec![(Duration::ZERO, head.as_bytes().to_vec())];
    for event in events {
        let data = format!("data: {event}\n\n");
        out.push((gap, format!("{:x}\r\n{data}\r\n", data.len()).into_bytes()));
    }
    out.push((stall, b"0\r\n\r\n".to_vec()));
    out
}

fn engine(idle: Duration) -> Arc<Engine> {
    Engine::for_tests(idle)
}

fn embedded(engine: &Arc<Engine>, api_keys: &[&str], disaggregation: Option<PdProtocol>) -> Embedded {
    let config = EdgeConfig {
        api_keys: api_keys.iter().map(|k| (*k).to_owned()).collect(),
        max_body_size: 1024,
        body_timeout: Duration::from_secs(5),
        disaggregation,
        access_log: None,
        header_read_timeout: Duration::from_secs(5),
        control_socket: std::path::PathBuf::new(),
        control_timeout: Duration::from_secs(5),
        control_stale_after: Duration::from_secs(5),
        pd_probe_timeout: Duration::from_secs(1),
        cors: None,
        tls: None,
        max_connections: 16,
    };
    Embedded::new(Arc::clone(engine), config)
}

fn add(engine: &Engine, node: &FakeNode, role: Role) {
    let spec = NodeSpec { role, models: vec!["m".to_owned()], ..NodeSpec::default() };
    engine.add_node(&node.url, spec).unwrap().counters().set_state(NodeState::Healthy);
}

/// Serves a POST of `body` to `path` through `pipeline`: the status, headers and whole body.
async fn post(
    pipeline: &Embedded,
    path: &str,
    body: std::result::Result<&[u8], BodyError>,
    headers: &[(&str, &str)],
) -> (u16, http::HeaderMap, Bytes) {
    let mut request = Request::builder().method("POST").uri(path);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let (parts, ()) = request.body(()).unwrap().into_parts();
    let strategy = pipeline.strategy(path).expect("an inference path");
    let peer: SocketAddr = "127.0.0.1:4000".parse().unwrap();
    let body = body.map(Bytes::copy_from_slice);
    let response = pipeline.serve(parts, body, peer, strategy).await;
    let (head, body) = response.into_parts();
    let bytes = collect(body).await;
    (head.status.as_u16(), head.headers, bytes)
}

async fn collect(body: EdgeBody) -> Bytes {
    let mut out = Vec::new();
    let mut body = body;
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(frame) => out.extend_from_slice(frame.data_ref().map_or(&[][..], |d| &d[..])),
            Err(_) => break,
        }
    }
    Bytes::from(out)
}

fn chat(stream: bool) -> Vec<u8> {
    serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream})
        .to_string()
        .into_bytes()
}

fn error_code(body: &[u8]) -> String {
    let value: serde_json::Value = serde_json::from_slice(body).unwrap();
    value["error"]["code"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn hybrid_relays_the_nodes_answer_whole_events_and_all() {
    let node = FakeNode::start(|_, body| {
        if body["stream"] == true {
            stream_answer(&["{\"a\":1}", "{\"b\":2}", "[DONE]"], Duration::from_millis(5), Duration::ZERO)
        } else {
            json_answer(200, &serde_json::json!({"id": "x"}))
        }
    })
    .await;
    let engine = engine(Duration::from_secs(5));
    add(&engine, &node, Role::Hybrid);
    let pipeline = embedded(&engine, &[], None);
    let (status, headers, body) = post(&pipeline, "/v1/chat/completions", Ok(&chat(false)), &[]).await;
    assert_eq!((status, &body[..]), (200, &br#"{"id":"x"}"#[..]));
    assert!(headers.contains_key("x-request-id"));
    let (status, _, body) = post(&pipeline, "/v1/chat/completions", Ok(&chat(true)), &[]).await;
    assert_eq!(status, 200);
    assert_eq!(&body[..], b"data: {\"a\":1}\n\ndata: {\"b\":2}\n\ndata: [DONE]\n\n");
    let (path, sent) = node.seen()[0].clone();
    assert_eq!((path.as_str(), sent["model"].as_str()), ("/v1/chat/completions", Some("m")));
    assert_eq!(engine.node(&node.url).unwrap().counters().in_flight(), 0, "every permit given back");
}

#[tokio::test]
async fn each_phase_refuses_with_its_own_error() {
    let node = FakeNode::start(|_, _| json_answer(200, &serde_json::json!({}))).await;
    let engine = engine(Duration::from_secs(5));
    add(&engine, &node, Role::Hybrid);
    let pipeline = embedded(&engine, &["k"], None);
    let key = [("authorization", "Bearer k")];
    let (status, headers, body) = post(&pipeline, "/v1/chat/completions", Ok(&chat(false)), &[]).await;
    assert_eq!((status, error_code(&body)), (401, "unauthorized".to_owned()));
    assert_eq!(headers["www-authenticate"], "Bearer");
    let (status, headers, body) = post(&pipeline, "/v1/chat/completions", Err(BodyError::TooLarge(None)), &key).await;
    assert_eq!((status, error_code(&body)), (413, "request_too_large".to_owned()));
    assert_eq!(headers["connection"], "close");
    let (status, _, body) = post(&pipeline, "/v1/chat/completions", Ok(&[b'x'; 2000]), &key).await;
    assert_eq!(status, 413, "a body read whole is held to the limit too: {body:?}");
    let (status, _, body) = post(&pipeline, "/v1/chat/completions", Err(BodyError::Timeout), &key).await;
    assert_eq!((status, error_code(&body)), (408, "request_timeout".to_owned()));
    let (status, _, body) = post(&pipeline, "/v1/chat/completions", Ok(b"{"), &key).await;
    assert_eq!((status, error_code(&body)), (400, "invalid_request".to_owned()));
    let unknown = br#"{"model": "nope", "messages": []}"#;
    let (status, _, body) = post(&pipeline, "/v1/chat/completions", Ok(unknown), &key).await;
    assert_eq!((status, error_code(&body)), (404, "model_not_found".to_owned()));
    let (status, _, body) = post(&pipeline, "/v1/other", Ok(b"{}"), &key).await;
    assert_eq!((status, error_code(&body)), (404, "not_found".to_owned()), "a pass-through path needs a model");
    let media = [("authorization", "Bearer k"), ("content-type", "text/plain")];
    let (status, _, _) = post(&pipeline, "/v1/chat/completions", Ok(&chat(false)), &media).await;
    assert_eq!(status, 415);
    assert!(node.seen().is_empty(), "no refused request reached the node");
}

#[tokio::test]
async fn the_relay_ends_a_silent_stream_with_a_terminal_event() {
    let node = FakeNode::start(|_, _| stream_answer(&["{\"a\":1}"], Duration::ZERO, Duration::from_millis(800))).await;
    let engine = engine(Duration::from_millis(200));
    add(&engine, &node, Role::Hybrid);
    let pipeline = embedded(&engine, &[], None);
    let (status, _, body) = post(&pipeline, "/v1/chat/completions", Ok(&chat(true)), &[]).await;
    assert_eq!(status, 200);
    let text = String::from_utf8_lossy(&body);
    assert!(text.starts_with("data: {\"a\":1}\n\ndata: {\"error\":"), "{text}");
    assert!(text.contains("upstream_timeout") && text.ends_with("\n\n"), "{text}");
}

#[tokio::test]
async fn vllm_hands_the_prefills_params_to_the_decode_verbatim() {
    let params = r#"{"remote_engine_id":"e1","remote_block_ids":[1,2],"remote_host":"h","remote_port":9}"#;
    let answer = format!(r#"{{"id":"p","kv_transfer_params":{params}}}"#);
    let prefill = FakeNode::start(move |_, _| json_answer(200, &serde_json::from_str(&answer).unwrap())).await;
    let decode = FakeNode::start(|_, _| json_answer(200, &serde_json::json!({"id": "d"}))).await;
    let engine = engine(Duration::from_secs(5));
    add(&engine, &prefill, Role::Prefill);
    add(&engine, &decode, Role::Decode);
    let pipeline = embedded(&engine, &[], Some(PdProtocol::Vllm));
    let (status, _, body) = post(&pipeline, "/v1/chat/completions", Ok(&chat(true)), &[]).await;
    assert_eq!((status, &body[..]), (200, &br#"{"id":"d"}"#[..]));
    let (_, sent) = prefill.seen()[0].clone();
    assert_eq!((sent["max_tokens"].as_i64(), sent["stream"].as_bool()), (Some(1), Some(false)));
    assert_eq!(sent["kv_transfer_params"]["do_remote_decode"], true);
    let (_, sent) = decode.seen()[0].clone();
    assert_eq!(sent["kv_transfer_params"], serde_json::from_str::<serde_json::Value>(params).unwrap());
    assert_eq!(sent["stream"], true, "the decode gets the client's own body");
}

#[tokio::test]
async fn sglang_sends_both_legs_one_room_at_the_prefills_bootstrap() {
    let prefill = FakeNode::start(|path, _| match path {
        "/server_info" => json_answer(200, &serde_json::json!({"disaggregation_bootstrap_port": 8998})),
        _ => json_answer(200, &serde_json::json!({"id": "p"})),
    })
    .await;
    let decode = FakeNode::start(|_, _| json_answer(200, &serde_json::json!({"id": "d"}))).await;
    let engine = engine(Duration::from_secs(5));
    add(&engine, &prefill, Role::Prefill);
    add(&engine, &decode, Role::Decode);
    let pipeline = embedded(&engine, &[], Some(PdProtocol::Sglang));
    let (status, _, body) = post(&pipeline, "/v1/chat/completions", Ok(&chat(false)), &[]).await;
    assert_eq!((status, &body[..]), (200, &br#"{"id":"d"}"#[..]));
    let legs: HashMap<String, serde_json::Value> = prefill
        .seen()
        .into_iter()
        .chain(decode.seen())
        .filter(|(p, _)| p != "/server_info")
        .enumerate()
        .map(|(i, (_, b))| (i.to_string(), b))
        .collect();
    assert_eq!(legs.len(), 2);
    let (a, b) = (&legs["0"], &legs["1"]);
    assert_eq!(a, b, "one body for both legs");
    assert_eq!((a["bootstrap_host"].as_str(), a["bootstrap_port"].as_u64()), (Some("127.0.0.1"), Some(8998)));
    assert!(a["bootstrap_room"].as_u64().is_some());
}

/// Links every pair at once, counting the asks.
struct Linked(Arc<AtomicUsize>);

impl LinkMaker for Linked {
    fn connect(&self, _: &str, _: &str) -> oneshot::Receiver<Result<()>> {
        self.0.fetch_add(1, Ordering::Relaxed);
        let (sender, receiver) = oneshot::channel();
        let _ = sender.send(Ok(()));
        receiver
    }
}

fn start_distserve(engine: &Engine, asks: &Arc<AtomicUsize>) -> Arc<DistServe> {
    let config = DistServeConfig {
        migration_protocol: 2,
        dummy_prefill: false,
        free_timeout: Duration::from_secs(1),
        free_attempts: 2,
        journal: None,
    };
    let distserve = Arc::new(DistServe::new(config, Box::new(Linked(Arc::clone(asks)))));
    engine.distserve.store(Some(Arc::clone(&distserve)));
    distserve
}

#[tokio::test]
async fn lmdeploy_migrates_the_session_and_frees_it_when_the_decode_fails() {
    let prefill = FakeNode::start(|path, _| match path {
        "/distserve/free_cache" => json_answer(200, &serde_json::json!({"success": true})),
        _ => json_answer(200, &serde_json::json!({"id": "7", "cache_block_ids": [3, 4], "remote_token_ids": [9]})),
    })
    .await;
    let fail_decode = Arc::new(AtomicUsize::new(0));
    let fail = Arc::clone(&fail_decode);
    let decode = FakeNode::start(move |_, _| {
        if fail.load(Ordering::Relaxed) > 0 {
            json_answer(500, &serde_json::json!({"error": "decode failed"}))
        } else {
            json_answer(200, &serde_json::json!({"id": "d"}))
        }
    })
    .await;
    let engine = engine(Duration::from_secs(5));
    add(&engine, &prefill, Role::Prefill);
    add(&engine, &decode, Role::Decode);
    let asks = Arc::new(AtomicUsize::new(0));
    let distserve = start_distserve(&engine, &asks);
    let pipeline = embedded(&engine, &[], Some(PdProtocol::Lmdeploy));

    let (status, _, _) = post(&pipeline, "/v1/chat/completions", Ok(&chat(true)), &[]).await;
    assert_eq!(status, 200);
    let (_, sent) = prefill.seen()[0].clone();
    assert_eq!((sent["with_cache"].as_bool(), sent["preserve_cache"].as_bool()), (Some(true), Some(true)));
    assert_eq!((sent["max_tokens"].as_i64(), sent["max_completion_tokens"].as_i64()), (Some(1), Some(1)));
    let (_, sent) = decode.seen()[0].clone();
    let migration = &sent["migration_request"];
    assert_eq!((migration["remote_session_id"].as_u64(), migration["remote_token_id"].as_i64()), (Some(7), Some(9)));
    assert_eq!(
        (migration["remote_engine_id"].as_str(), migration["protocol"].as_u64()),
        (Some(&prefill.url[..]), Some(2))
    );
    assert_eq!(distserve.sessions.consumed.load(Ordering::Relaxed), 1);

    fail_decode.store(1, Ordering::Relaxed);
    let (status, _, _) = post(&pipeline, "/v1/chat/completions", Ok(&chat(true)), &[]).await;
    assert_eq!(status, 500, "the decode's own error");
    for _ in 0..100 {
        if distserve.sessions.freed.load(Ordering::Relaxed) == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let frees: Vec<_> = prefill.seen().into_iter().filter(|(path, _)| path == "/distserve/free_cache").collect();
    assert_eq!(frees.len(), 1, "freed exactly once");
    assert_eq!(frees[0].1["remote_session_id"], 7);
    assert_eq!(distserve.sessions.held().0, 0);
    assert_eq!(asks.load(Ordering::Relaxed), 1, "the link was asked for once, then read");
}
