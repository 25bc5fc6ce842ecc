//! A scripted upstream on a real socket for the data plane's integration tests.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::channel::Channel;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The SSE body `/sse` sends: `n` events of growing size.
pub fn sse_body(n: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for i in 0..n {
        out.extend_from_slice(format!("data: {{\"i\":{i},\"pad\":\"{}\"}}\n\n", "x".repeat(i % 37)).as_bytes());
    }
    out.extend_from_slice(b"data: [DONE]\n\n");
    out
}

async fn handle(req: Request<Incoming>) -> Result<Response<BoxBody<Bytes, BoxError>>, Infallible> {
    let path = req.uri().path().to_owned();
    let full = |status: u16, ct: &str, body: &'static str| {
        Response::builder()
            .status(status)
            .header("content-type", ct)
            .body(Full::new(Bytes::from_static(body.as_bytes())).map_err(|e| match e {}).boxed())
            .unwrap()
    };
    Ok(match path.as_str() {
        "/json" => full(200, "application/json", r#"{"ok":true}"#),
        "/error" => full(503, "application/json", r#"{"error":{"message":"busy"}}"#),
        "/hang" => {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            unreachable!()
        }
        "/sse" | "/sse-torn" => {
            let (mut tx, body) = Channel::<Bytes, BoxError>::new(16);
            let torn = path == "/sse-torn";
            tokio::spawn(async move {
                let bytes = sse_body(200);
                // Fragments of irregular sizes, each written on its own.
                let mut start = 0;
                let mut size = 1;
                while start < bytes.len() {
                    let end = (start + size).min(bytes.len());
                    if torn && end > bytes.len() / 2 {
                        tx.abort("torn".into());
                        return;
                    }
                    if tx.send_data(Bytes::copy_from_slice(&bytes[start..end])).await.is_err() {
                        return;
                    }
                    tokio::task::yield_now().await;
                    start = end;
                    size = size * 7 % 113 + 1;
                }
            });
            Response::builder().header("content-type", "text/event-stream").body(body.boxed()).unwrap()
        }
        _ => full(404, "text/plain", "not found"),
    })
}

/// Serves the scripted upstream on an ephemeral port for the rest of the test.
pub async fn upstream() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { return };
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service_fn(handle))
                    .await;
            });
        }
    });
    addr
}
