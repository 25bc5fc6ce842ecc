//! The body of the control plane's answer, and the pool its connection goes back to.

use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;

use crate::error::BoxError;

/// Idle connections kept to the control plane: as many as the requests it may serve at once
/// (LMDeploy's DistServe streams all go through it), so that none has to connect anew.
const POOL_SIZE: usize = 1024;

/// Idle connections to the control plane.
pub(crate) type Idle = Arc<Mutex<Vec<SendRequest<Incoming>>>>;

/// The control plane's answer body; its connection goes back to the pool once the body ended.
pub(crate) struct ControlBody {
    pub(super) body: Incoming,
    pub(super) sender: Option<SendRequest<Incoming>>,
    pub(super) idle: Idle,
}

impl ControlBody {
    /// Back to the pool once the connection can take the next request.
    fn recycle(&mut self) {
        if let Some(mut sender) = self.sender.take() {
            let idle = Arc::clone(&self.idle);
            tokio::spawn(async move {
                if sender.ready().await.is_ok() {
                    let mut idle = idle.lock().unwrap_or_else(PoisonError::into_inner);
                    if idle.len() < POOL_SIZE {
                        idle.push(sender);
                    }
                }
            });
        }
    }
}

impl Body for ControlBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        match polled {
            Poll::Ready(None) => {
                self.recycle();
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(Box::new(e)))),
            Poll::Ready(Some(Ok(frame))) => {
                if self.body.is_end_stream() {
                    self.recycle();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}
