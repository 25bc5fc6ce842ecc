//! The wall clock that worker processes sharing a node table agree on.

use std::time::{SystemTime, UNIX_EPOCH};

/// Wall-clock microseconds: the one clock that worker processes sharing a circuit (or a
/// node's counters) agree on (a clock step only lengthens or shortens one cooldown).
pub(crate) fn now_us() -> u64 {
    let since_epoch = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    u64::try_from(since_epoch.as_micros()).unwrap_or(u64::MAX)
}

/// The same clock in milliseconds.
pub(crate) fn now_ms() -> u64 {
    now_us() / 1000
}
