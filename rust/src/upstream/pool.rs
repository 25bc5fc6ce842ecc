//! Idle keep-alive connections, per node address: the most recently used first, none kept
//! longer than the idle timeout (which should stay below the nodes' own keep-alive).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use tokio::net::TcpStream;

/// One connection to a node, with what has been read from it and not consumed yet.
#[derive(Debug)]
pub struct Connection {
    pub stream: TcpStream,
    pub buffer: BytesMut,
}

#[derive(Debug)]
struct Idle {
    connection: Connection,
    since: Instant,
}

#[derive(Debug)]
struct Shared {
    idle: Mutex<HashMap<String, Vec<Idle>>>,
    max_per_host: usize,
    idle_timeout: Duration,
}

#[derive(Debug, Clone)]
pub struct Pool(Arc<Shared>);

impl Pool {
    pub fn new(max_per_host: usize, idle_timeout: Duration) -> Self {
        Self(Arc::new(Shared { idle: Mutex::default(), max_per_host, idle_timeout }))
    }

    /// An idle connection to `host` that is still open, if any.
    pub fn checkout(&self, host: &str) -> Option<Connection> {
        let mut idle = self.0.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let list = idle.get_mut(host)?;
        while let Some(Idle { connection, since }) = list.pop() {
            if since.elapsed() < self.0.idle_timeout && still_open(&connection.stream) {
                return Some(connection);
            }
        }
        None
    }

    /// Where a body gives its connection back once it has been read to its end.
    pub fn returner(&self, host: &str) -> Returner {
        Returner { pool: self.clone(), host: host.to_owned() }
    }

    fn put(&self, host: String, connection: Connection) {
        if !connection.buffer.is_empty() {
            return; // the node sent more than its answer: not safe to reuse
        }
        let mut idle = self.0.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let list = idle.entry(host).or_default();
        if list.len() < self.0.max_per_host {
            list.push(Idle { connection, since: Instant::now() });
        }
    }
}

/// Gives a connection back to the pool it came from.
#[derive(Debug)]
pub struct Returner {
    pool: Pool,
    host: String,
}

impl Returner {
    pub fn give_back(self, connection: Connection) {
        self.pool.put(self.host, connection);
    }
}

/// An idle connection is usable when nothing is waiting on it: no data (the node has nothing
/// to say between answers) and no end (it has not closed). Reads only what the event loop
/// already knows, so a healthy connection costs no system call.
fn still_open(stream: &TcpStream) -> bool {
    let mut probe = [0u8; 1];
    matches!(stream.try_read(&mut probe), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
}
