//! Joining a body's pieces into one `Bytes`: the first piece is kept as it is, so that a body
//! that comes in one piece is never copied, and the rest are copied after it into one buffer.

use bytes::{Bytes, BytesMut};

/// The pieces of a body so far, joined as they come.
#[derive(Debug, Default)]
pub(crate) struct Coalescer {
    first: Option<Bytes>,
    joined: Option<BytesMut>,
    /// The least the joined buffer starts with: a declared length is its size at once, since
    /// growing by doubling leaves a trail of freed buffers behind a large body, which the
    /// allocator cannot always give back.
    expected: usize,
}

impl Coalescer {
    /// A coalescer for a body expected to be `expected` bytes long (0: not known).
    pub(crate) fn expecting(expected: usize) -> Self {
        Self { expected, ..Self::default() }
    }

    pub(crate) fn push(&mut self, data: Bytes) {
        match (&self.first, &mut self.joined) {
            (None, _) => self.first = Some(data),
            (Some(first), None) => {
                let mut all = BytesMut::with_capacity(self.expected.max((first.len() + data.len()) * 2));
                all.extend_from_slice(first);
                all.extend_from_slice(&data);
                self.joined = Some(all);
            }
            (Some(_), Some(all)) => all.extend_from_slice(&data),
        }
    }

    /// No piece yet.
    pub(crate) fn is_empty(&self) -> bool {
        self.first.is_none()
    }

    /// The pieces as one, or None when none came.
    pub(crate) fn take(self) -> Option<Bytes> {
        self.joined.map(BytesMut::freeze).or(self.first)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_in_one_piece_is_not_copied() {
        let piece = Bytes::from_static(b"whole");
        let mut body = Coalescer::default();
        body.push(piece.clone());
        let out = body.take().unwrap();
        assert_eq!(out.as_ptr(), piece.as_ptr());
    }

    #[test]
    fn pieces_are_joined_in_order() {
        let mut body = Coalescer::default();
        assert!(body.is_empty());
        for piece in ["a", "bc", "", "def"] {
            body.push(Bytes::from(piece));
        }
        assert!(!body.is_empty());
        assert_eq!(body.take().unwrap(), Bytes::from_static(b"abcdef"));
        assert_eq!(Coalescer::default().take(), None);
    }

    #[test]
    fn a_declared_length_sizes_the_buffer_at_once() {
        let mut body = Coalescer::expecting(1 << 20);
        body.push(Bytes::from_static(b"head"));
        body.push(Bytes::from_static(b"tail"));
        assert!(body.joined.as_ref().unwrap().capacity() >= 1 << 20);
    }
}
