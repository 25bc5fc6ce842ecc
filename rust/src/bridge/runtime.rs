//! The one tokio runtime of the data plane. It is built lazily by the first router of a
//! process, so a process that forks (granian workers) builds its own after the fork; a
//! runtime inherited across a fork has no threads, so using one is refused.

use std::sync::OnceLock;

use tokio::runtime::{Builder, Runtime};

use crate::error::{Error, Kind, Result};

static RUNTIME: OnceLock<(u32, Runtime)> = OnceLock::new();

/// The process's runtime, built with `worker_threads` threads on first use (later calls
/// share it, whatever they ask for).
pub(crate) fn get(worker_threads: usize) -> Result<&'static Runtime> {
    if RUNTIME.get().is_none() {
        let runtime = Builder::new_multi_thread()
            .worker_threads(worker_threads.max(1))
            .thread_name("pdproxy-io")
            .enable_all()
            .build()
            .map_err(|e| Error::with_source(Kind::InvalidRequest, "the data plane's runtime cannot start", e))?;
        // Another thread may have won the race; its runtime serves, this one is dropped.
        let _ = RUNTIME.set((std::process::id(), runtime));
    }
    match RUNTIME.get() {
        Some((pid, runtime)) if *pid == std::process::id() => Ok(runtime),
        _ => Err(Error::new(
            Kind::InvalidRequest,
            "pdproxy's runtime was started before this process forked: create routers after the fork",
        )),
    }
}
