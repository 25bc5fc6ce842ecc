//! The one tokio runtime of the data plane. It is built lazily by the first router in a
//! process, so a process that forks (granian workers) builds its own after the fork.

use tokio::runtime::Builder;

/// A multi-threaded runtime builder with named threads.
pub fn builder(worker_threads: usize) -> Builder {
    let mut builder = Builder::new_multi_thread();
    builder.worker_threads(worker_threads.max(1)).thread_name("pdproxy-io").enable_all();
    builder
}
