//! The body of a node's answer, read from its connection as it is consumed; the connection
//! returns to the pool once the body has been read to its end, and is closed otherwise.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Frame, SizeHint};

use super::codec::{decode, poll_fill, Framing};
use super::pool::{Connection, Returner};
use crate::error::{BoxError, Error, Kind};

#[derive(Debug)]
pub(crate) struct Body {
    connection: Option<Connection>,
    framing: Framing,
    reusable: bool,
    returner: Option<Returner>,
}

impl Body {
    pub(super) fn new(connection: Connection, framing: Framing, reusable: bool, returner: Returner) -> Self {
        Self { connection: Some(connection), framing, reusable, returner: Some(returner) }
    }

    /// The body has been read whole: its connection goes back to the pool when it can serve again.
    fn ended(&mut self) {
        if let (Some(connection), Some(returner), true) = (self.connection.take(), self.returner.take(), self.reusable)
        {
            returner.give_back(connection);
        }
    }

    fn failed(
        &mut self,
        why: &'static str,
        source: Option<std::io::Error>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.connection = None;
        self.framing = Framing::Done;
        let error = match source {
            Some(e) => Error::with_source(Kind::Upstream, why, e),
            None => Error::new(Kind::Upstream, why),
        };
        Poll::Ready(Some(Err(Box::new(error))))
    }
}

impl http_body::Body for Body {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        loop {
            let Some(connection) = this.connection.as_mut() else { return Poll::Ready(None) };
            let decoded = match decode(&mut connection.buffer, &mut this.framing) {
                Ok(decoded) => decoded,
                Err(why) => return this.failed(why, None),
            };
            if decoded.done {
                this.ended();
                return Poll::Ready(decoded.data.map(|data| Ok(Frame::data(data))));
            }
            if let Some(data) = decoded.data {
                return Poll::Ready(Some(Ok(Frame::data(data))));
            }
            match poll_fill(connection, cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(0)) if this.framing == Framing::Close => {
                    this.framing = Framing::Done;
                    this.connection = None;
                    return Poll::Ready(None);
                }
                Poll::Ready(Ok(0)) => {
                    return this.failed("the node closed the connection before the end of its answer", None)
                }
                Poll::Ready(Ok(_)) => {}
                Poll::Ready(Err(e)) => return this.failed("the node broke off its answer", Some(e)),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.framing == Framing::Done || self.connection.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        match self.framing {
            Framing::Length(left) => SizeHint::with_exact(left),
            Framing::Done => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}
