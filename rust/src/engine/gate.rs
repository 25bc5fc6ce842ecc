//! The proxy's own gate: a global cap on inference requests served at once, and the drain
//! switch. Shared by the edge and the control plane, so one count covers both.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::Notify;

/// Why the gate refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    Draining,
    /// `max_requests` are being served.
    Full,
}

#[derive(Debug, Default)]
pub struct Gate {
    /// 0: no cap.
    max_requests: usize,
    serving: AtomicUsize,
    draining: AtomicBool,
    /// Signalled whenever the count drops to zero.
    idle: Notify,
}

impl Gate {
    pub fn new(max_requests: usize) -> Self {
        Self { max_requests, ..Self::default() }
    }

    /// Counts one request in, unless the proxy drains or is at its cap.
    pub fn enter(&self) -> Result<(), Refusal> {
        if self.draining.load(Ordering::Acquire) {
            return Err(Refusal::Draining);
        }
        let max = self.max_requests;
        self.serving
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (max == 0 || n < max).then_some(n + 1))
            .map(|_| ())
            .map_err(|_| Refusal::Full)
    }

    /// Counts one request out (after a successful `enter`).
    pub fn leave(&self) {
        if self.serving.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.idle.notify_waiters();
        }
    }

    /// `enter`, as a pass that leaves when dropped.
    pub fn pass(self: &Arc<Self>) -> Result<GatePass, Refusal> {
        self.enter()?;
        Ok(GatePass(Arc::clone(self)))
    }

    pub fn serving(&self) -> usize {
        self.serving.load(Ordering::Acquire)
    }

    pub fn max_requests(&self) -> usize {
        self.max_requests
    }

    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Release);
    }

    /// Waits until no request is being served.
    pub async fn idle(&self) {
        loop {
            let notified = self.idle.notified();
            if self.serving() == 0 {
                return;
            }
            notified.await;
        }
    }
}

/// One request counted in the gate.
#[derive(Debug)]
pub struct GatePass(Arc<Gate>);

impl Drop for GatePass {
    fn drop(&mut self) {
        self.0.leave();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_and_drains() {
        let gate = Arc::new(Gate::new(1));
        let pass = gate.pass().unwrap();
        assert_eq!(gate.enter(), Err(Refusal::Full));
        drop(pass);
        assert_eq!(gate.serving(), 0);
        gate.start_draining();
        assert_eq!(gate.enter(), Err(Refusal::Draining));
    }
}
