//! The doorbell: how runtime threads wake the Python event loop without taking the GIL.
//!
//! The loop watches the read end of a socket pair (`loop.add_reader`). A thread that has
//! work for the loop queues it, then rings; only the first ring after the loop last
//! answered writes a byte, so a burst of completions costs one wake-up and one syscall.

use std::io::{self, ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};

#[derive(Debug)]
pub(crate) struct Doorbell {
    armed: AtomicBool,
    bell: UnixStream,
    listener: UnixStream,
}

impl Doorbell {
    pub(crate) fn new() -> io::Result<Self> {
        let (bell, listener) = UnixStream::pair()?;
        bell.set_nonblocking(true)?;
        listener.set_nonblocking(true)?;
        Ok(Self { armed: AtomicBool::new(false), bell, listener })
    }

    /// The descriptor the event loop watches for readability.
    pub(crate) fn fd(&self) -> RawFd {
        self.listener.as_raw_fd()
    }

    /// Wakes the loop unless it is already due to wake. Call after queueing the work.
    pub(crate) fn ring(&self) {
        if !self.armed.swap(true, Ordering::AcqRel) {
            // A full socket buffer means the loop has bytes to read already: it will wake.
            let _ = (&self.bell).write(&[1]);
        }
    }

    /// Called by the loop when it wakes, before it takes the queued work: rings that come
    /// after this write again, so no work is left unnoticed.
    pub(crate) fn answer(&self) {
        let mut sink = [0u8; 64];
        loop {
            match (&self.listener).read(&mut sink) {
                Ok(n) if n == sink.len() => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                _ => break,
            }
        }
        self.armed.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes waiting for the loop (consumes them).
    fn waiting_bytes(bell: &Doorbell) -> usize {
        let mut buf = [0u8; 16];
        (&bell.listener).read(&mut buf).unwrap_or(0)
    }

    #[test]
    fn rings_once_until_answered() {
        let bell = Doorbell::new().unwrap();
        assert_eq!(waiting_bytes(&bell), 0);
        bell.ring();
        bell.ring();
        assert_eq!(waiting_bytes(&bell), 1, "the second ring must not write");
        bell.answer();
        bell.ring();
        assert_eq!(waiting_bytes(&bell), 1, "a ring after the answer wakes the loop again");
    }
}
