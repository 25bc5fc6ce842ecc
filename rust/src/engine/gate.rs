//! The proxy's own gate: a global cap on inference requests served at once, and the drain
//! switch. Shared by the edge and the control plane, so one count covers both.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::Notify;

/// Why the gate refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    Draining,
    /// `max_requests` are being served.
    Full,
}

#[derive(Debug, Default)]
pub(crate) struct Gate {
    /// 0: no cap.
    max_requests: usize,
    serving: AtomicUsize,
    draining: AtomicBool,
    /// Signalled whenever the count drops to zero.
    idle: Notify,
}

impl Gate {
    pub(crate) fn new(max_requests: usize) -> Self {
        Self { max_requests, ..Self::default() }
    }

    /// Counts one request in, unless the proxy drains or is at its cap.
    pub(crate) fn enter(&self) -> Result<(), Refusal> {
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
    pub(crate) fn leave(&self) {
        if self.serving.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.idle.notify_waiters();
        }
    }

    /// `enter`, as a pass that leaves when dropped.
    pub(crate) fn pass(self: &Arc<Self>) -> Result<GatePass, Refusal> {
        self.enter()?;
        Ok(GatePass(Arc::clone(self)))
    }

    pub(crate) fn serving(&self) -> usize {
        self.serving.load(Ordering::Acquire)
    }

    pub(crate) fn max_requests(&self) -> usize {
        self.max_requests
    }

    pub(crate) fn draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    pub(crate) fn start_draining(&self) {
        self.draining.store(true, Ordering::Release);
    }
}

/// One request counted in the gate.
#[derive(Debug)]
pub(crate) struct GatePass(Arc<Gate>);

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
