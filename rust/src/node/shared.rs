//! The shared node table of a worker group (`pdproxy serve --workers N`): every node's
//! counters (in flight, cap, state, circuit, statistics) in one memory-mapped file that each
//! worker process maps. The hot path touches only atomics in it, so a node's cap holds across
//! all workers together with the same single compare-and-swap as in one process.
//!
//! Layout: a header, a table of workers (their pids), and a fixed number of node slots. A slot
//! is bound to a node URL for the life of one registration (its generation); removing the node
//! retires the slot, and a retired slot is reused only once nothing is in flight on it and a
//! grace period has passed, long enough for every worker to have dropped its binding.
//!
//! Each worker also counts its own share of every slot's in-flight count, so that when a
//! worker dies its permits are handed back (`reclaim`) and the counts do not drift. The
//! order of the two updates leaves any crash in between as an over-count, never an under-count:
//! a cap can be too strict for a moment, never exceeded.
//!
//! This module holds the crate's only `unsafe` code: viewing the mapping as the table.
#![allow(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::time::{Duration, Instant};

use memmap2::MmapRaw;

use crate::clock::now_ms;
use crate::error::{Error, Kind, Result};
use crate::node::NodeCounters;

/// Node slots in a table: registrations alive at once, retired ones included.
pub(crate) const SLOTS: usize = 1024;
/// Worker processes that can be attached at once (live ones plus dead ones not yet reclaimed).
pub(crate) const MAX_WORKERS: usize = 64;
/// The longest node URL a slot holds.
pub(crate) const URL_MAX: usize = 256;

const MAGIC: u64 = u64::from_le_bytes(*b"pdproxy\x01");
const FREE: u32 = 0;
const ACTIVE: u32 = 1;
const RETIRED: u32 = 2;
/// A worker entry being reclaimed: neither free nor owned.
const RECLAIMING: u32 = u32::MAX;
/// How long a lock holder may keep the slot directory before it is presumed dead. Holders
/// keep it for microseconds; only a process killed inside one would ever reach this.
const LOCK_STEAL_AFTER: Duration = Duration::from_secs(1);

#[repr(C)]
struct Header {
    magic: AtomicU64,
    /// The table's size: a file written by another build of pdproxy is refused.
    layout: AtomicU64,
    /// Bumped after every membership change; workers poll it.
    epoch: AtomicU64,
    next_generation: AtomicU64,
    /// The pid holding the slot directory's lock (control path only), 0 when free.
    lock: AtomicU32,
    /// Set when any worker is asked to drain: every worker drains.
    drain: AtomicU32,
}

#[repr(C)]
struct Slot {
    state: AtomicU32,
    url_len: AtomicU32,
    generation: AtomicU64,
    retired_ms: AtomicU64,
    url: [AtomicU8; URL_MAX],
    counters: NodeCounters,
    /// Each worker's part of `counters.in_flight`.
    shares: [AtomicU32; MAX_WORKERS],
}

#[repr(C)]
struct Table {
    header: Header,
    workers: [AtomicU32; MAX_WORKERS],
    slots: [Slot; SLOTS],
}

/// One mapping of a table file.
#[derive(Debug)]
pub(crate) struct SharedTable {
    map: MmapRaw,
    /// Keeps the file open as long as the mapping lives.
    _file: File,
}

/// The slot a node's counters live in, and its generation.
pub(crate) type Binding = (usize, u64);

impl SharedTable {
    /// The size of a table file in bytes.
    pub(crate) const SIZE: usize = std::mem::size_of::<Table>();

    /// Creates a table file (zeroed: every slot free, every worker entry free). Fails if it exists.
    pub(crate) fn create(path: &Path) -> Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(|e| io_error("cannot create the shared table", path, e))?;
        file.set_len(Self::SIZE as u64).map_err(|e| io_error("cannot size the shared table", path, e))?;
        let table = Self::map(file, path)?;
        let header = &table.table().header;
        header.layout.store(Self::SIZE as u64, Ordering::Relaxed);
        header.magic.store(MAGIC, Ordering::Release);
        Ok(table)
    }

    /// Maps an existing table file.
    pub(crate) fn open(path: &Path) -> Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| io_error("cannot open the shared table", path, e))?;
        let len = file.metadata().map_err(|e| io_error("cannot read the shared table", path, e))?.len();
        if len != Self::SIZE as u64 {
            return Err(Error::new(
                Kind::Config,
                format!("{} is not a shared table of this pdproxy build ({len} bytes)", path.display()),
            ));
        }
        let table = Self::map(file, path)?;
        let header = &table.table().header;
        if header.magic.load(Ordering::Acquire) != MAGIC || header.layout.load(Ordering::Relaxed) != Self::SIZE as u64 {
            return Err(Error::new(
                Kind::Config,
                format!("{} is not a shared table of this pdproxy build", path.display()),
            ));
        }
        Ok(table)
    }

    fn map(file: File, path: &Path) -> Result<Self> {
        let map = MmapRaw::map_raw(&file).map_err(|e| io_error("cannot map the shared table", path, e))?;
        assert!(map.len() >= Self::SIZE);
        assert_eq!(map.as_ptr().align_offset(std::mem::align_of::<Table>()), 0, "mappings are page-aligned");
        Ok(Self { map, _file: file })
    }

    fn table(&self) -> &Table {
        // SAFETY: the mapping is at least `SIZE` bytes, page-aligned, and lives as long as
        // `self`. `Table` is made of atomics only (no pointers, no invariants beyond their
        // values) and all-zero bytes are a valid value of every field, so any bytes another
        // process wrote are a valid `Table`; all access goes through the atomics. Alignment is
        // checked when mapping.
        #[allow(clippy::cast_ptr_alignment)]
        unsafe {
            &*self.map.as_ptr().cast::<Table>()
        }
    }

    pub(crate) fn counters(&self, slot: usize) -> &NodeCounters {
        &self.table().slots[slot].counters
    }

    /// The part of a slot's in-flight count that belongs to `worker`.
    pub(crate) fn share(&self, slot: usize, worker: usize) -> &AtomicU32 {
        &self.table().slots[slot].shares[worker]
    }

    // --- workers ---

    /// Attaches a worker process: returns its index in the table.
    pub(crate) fn join(&self, pid: u32) -> Result<usize> {
        for (index, entry) in self.table().workers.iter().enumerate() {
            if entry.compare_exchange(0, pid, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                return Ok(index);
            }
        }
        Err(Error::new(Kind::Config, format!("the shared table has room for {MAX_WORKERS} workers")))
    }

    /// Attached workers: (index, pid).
    pub(crate) fn workers(&self) -> Vec<(usize, u32)> {
        self.table()
            .workers
            .iter()
            .enumerate()
            .map(|(i, pid)| (i, pid.load(Ordering::Acquire)))
            .filter(|&(_, pid)| pid != 0 && pid != RECLAIMING)
            .collect()
    }

    /// The in-flight units worker `index` holds now, over all slots.
    pub(crate) fn held(&self, index: usize) -> u64 {
        self.table().slots.iter().map(|slot| u64::from(slot.shares[index].load(Ordering::Relaxed))).sum()
    }

    /// Detaches worker `index` (which must be `pid`): every permit it still held is handed
    /// back. Call it for a worker that has exited; returns the permits handed back, or `None`
    /// when the entry is no longer `pid`'s (someone else reclaimed it).
    pub(crate) fn reclaim(&self, index: usize, pid: u32) -> Option<u64> {
        let entry = self.table().workers.get(index)?;
        entry.compare_exchange(pid, RECLAIMING, Ordering::AcqRel, Ordering::Acquire).ok()?;
        let mut returned = 0;
        for slot in &self.table().slots {
            let held = slot.shares[index].swap(0, Ordering::AcqRel);
            if held > 0 {
                slot.counters.in_flight.fetch_sub(u64::from(held), Ordering::AcqRel);
                returned += u64::from(held);
            }
        }
        entry.store(0, Ordering::Release);
        Some(returned)
    }

    // --- slots ---

    /// The slot bound to `url`, binding a free one if none is.
    pub(crate) fn bind(&self, url: &str) -> Result<Binding> {
        if url.len() > URL_MAX {
            return Err(Error::new(Kind::InvalidNode, format!("node URLs are limited to {URL_MAX} bytes")));
        }
        let _lock = self.lock();
        let slots = &self.table().slots;
        if let Some((index, slot)) =
            slots.iter().enumerate().find(|(_, s)| s.state.load(Ordering::Acquire) == ACTIVE && slot_url_is(s, url))
        {
            return Ok((index, slot.generation.load(Ordering::Acquire)));
        }
        let Some((index, slot)) = slots.iter().enumerate().find(|(_, s)| s.state.load(Ordering::Acquire) == FREE)
        else {
            return Err(Error::new(Kind::Overloaded, format!("all {SLOTS} node slots of the shared table are in use")));
        };
        for (byte, value) in slot.url.iter().zip(url.bytes()) {
            byte.store(value, Ordering::Relaxed);
        }
        slot.url_len.store(u32::try_from(url.len()).unwrap_or(0), Ordering::Relaxed);
        let generation = self.table().header.next_generation.fetch_add(1, Ordering::AcqRel) + 1;
        slot.generation.store(generation, Ordering::Release);
        slot.state.store(ACTIVE, Ordering::Release);
        Ok((index, generation))
    }

    /// Whether `binding` is still the slot's current registration.
    pub(crate) fn is_current(&self, (slot, generation): Binding) -> bool {
        let slot = &self.table().slots[slot];
        slot.state.load(Ordering::Acquire) == ACTIVE && slot.generation.load(Ordering::Acquire) == generation
    }

    /// Ends a registration: the slot takes no new binding and is reused once idle (`recycle`).
    pub(crate) fn retire(&self, binding: Binding) {
        let _lock = self.lock();
        if self.is_current(binding) {
            let slot = &self.table().slots[binding.0];
            slot.retired_ms.store(now_ms(), Ordering::Relaxed);
            slot.state.store(RETIRED, Ordering::Release);
        }
    }

    /// Frees retired slots with nothing in flight that were retired at least `grace` ago.
    /// Returns how many were freed.
    pub(crate) fn recycle(&self, grace: Duration) -> usize {
        let _lock = self.lock();
        let cutoff = now_ms().saturating_sub(u64::try_from(grace.as_millis()).unwrap_or(u64::MAX));
        let mut freed = 0;
        for slot in &self.table().slots {
            if slot.state.load(Ordering::Acquire) == RETIRED
                && slot.retired_ms.load(Ordering::Relaxed) <= cutoff
                && slot.counters.in_flight() == 0
            {
                slot.counters.reset();
                for share in &slot.shares {
                    share.store(0, Ordering::Relaxed);
                }
                slot.url_len.store(0, Ordering::Relaxed);
                slot.state.store(FREE, Ordering::Release);
                freed += 1;
            }
        }
        freed
    }

    /// Slots bound now and slots retired but not yet reusable.
    pub(crate) fn slots_in_use(&self) -> (usize, usize) {
        let count = |state| self.table().slots.iter().filter(|s| s.state.load(Ordering::Acquire) == state).count();
        (count(ACTIVE), count(RETIRED))
    }

    // --- group-wide signals ---

    pub(crate) fn epoch(&self) -> u64 {
        self.table().header.epoch.load(Ordering::Acquire)
    }

    /// Tells every worker that membership changed; returns the new epoch.
    pub(crate) fn bump_epoch(&self) -> u64 {
        self.table().header.epoch.fetch_add(1, Ordering::AcqRel) + 1
    }

    pub(crate) fn draining(&self) -> bool {
        self.table().header.drain.load(Ordering::Acquire) != 0
    }

    pub(crate) fn set_draining(&self) {
        self.table().header.drain.store(1, Ordering::Release);
    }

    /// The slot directory's lock: held by binds, retirements and recycling, never by requests.
    fn lock(&self) -> DirectoryLock<'_> {
        let lock = &self.table().header.lock;
        let me = std::process::id();
        let started = Instant::now();
        loop {
            let holder = lock.load(Ordering::Acquire);
            if holder == 0 && lock.compare_exchange(0, me, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                return DirectoryLock(lock);
            }
            if started.elapsed() > LOCK_STEAL_AFTER
                && lock.compare_exchange(holder, me, Ordering::AcqRel, Ordering::Acquire).is_ok()
            {
                return DirectoryLock(lock);
            }
            std::thread::yield_now();
        }
    }
}

struct DirectoryLock<'a>(&'a AtomicU32);

impl Drop for DirectoryLock<'_> {
    fn drop(&mut self) {
        self.0.store(0, Ordering::Release);
    }
}

fn slot_url_is(slot: &Slot, url: &str) -> bool {
    let len = slot.url_len.load(Ordering::Relaxed) as usize;
    len == url.len() && slot.url.iter().zip(url.bytes()).all(|(byte, value)| byte.load(Ordering::Relaxed) == value)
}

fn io_error(what: &str, path: &Path, e: std::io::Error) -> Error {
    Error::with_source(Kind::Config, format!("{what} {}", path.display()), e)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> (SharedTable, std::path::PathBuf) {
        let path =
            std::env::temp_dir().join(format!("pdproxy-shared-test-{}-{}", std::process::id(), fastrand::u64(..)));
        (SharedTable::create(&path).unwrap(), path)
    }

    #[test]
    fn two_mappings_share_counters() {
        let (a, path) = table();
        let b = SharedTable::open(&path).unwrap();
        let (slot, generation) = a.bind("http://h:1").unwrap();
        assert_eq!(b.bind("http://h:1").unwrap(), (slot, generation), "the same URL binds the same slot");
        a.counters(slot).in_flight.fetch_add(3, Ordering::AcqRel);
        assert_eq!(b.counters(slot).in_flight(), 3);
        assert_ne!(a.bind("http://h:2").unwrap().0, slot);
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn refuses_other_files() {
        let path = std::env::temp_dir().join(format!("pdproxy-shared-bad-{}", std::process::id()));
        std::fs::write(&path, b"not a table").unwrap();
        assert_eq!(SharedTable::open(&path).unwrap_err().kind(), Kind::Config);
        assert_eq!(SharedTable::create(&path).unwrap_err().kind(), Kind::Config, "never overwrites");
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn reclaim_hands_back_a_dead_workers_permits() {
        let (t, path) = table();
        let (slot, _) = t.bind("http://h:1").unwrap();
        let (w1, w2) = (t.join(101).unwrap(), t.join(102).unwrap());
        for (worker, n) in [(w1, 2), (w2, 5)] {
            t.counters(slot).in_flight.fetch_add(n, Ordering::AcqRel);
            t.share(slot, worker).fetch_add(u32::try_from(n).unwrap(), Ordering::AcqRel);
        }
        assert_eq!((t.held(w1), t.held(w2)), (2, 5));
        assert_eq!(t.reclaim(w2, 999), None, "only the pid that owns the entry");
        assert_eq!(t.reclaim(w2, 102), Some(5));
        assert_eq!(t.counters(slot).in_flight(), 2);
        assert_eq!(t.workers(), [(w1, 101)]);
        assert_eq!(t.join(103).unwrap(), w2, "a reclaimed entry is reused");
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn retired_slots_are_reused_only_when_idle_and_after_grace() {
        let (t, path) = table();
        let first = t.bind("http://h:1").unwrap();
        t.counters(first.0).in_flight.fetch_add(1, Ordering::AcqRel);
        t.counters(first.0).requests.fetch_add(7, Ordering::Relaxed);
        t.retire(first);
        assert!(!t.is_current(first));
        let second = t.bind("http://h:1").unwrap();
        assert!(second.0 != first.0 && second.1 > first.1, "a new registration gets a new slot");
        assert_eq!(t.recycle(Duration::ZERO), 0, "a request is still in flight on it");
        t.counters(first.0).in_flight.fetch_sub(1, Ordering::AcqRel);
        assert_eq!(t.recycle(Duration::from_secs(60)), 0, "within the grace period");
        assert_eq!(t.recycle(Duration::ZERO), 1);
        assert_eq!(t.counters(first.0).snapshot().requests, 0, "a recycled slot starts from zero");
        assert_eq!(t.slots_in_use(), (1, 0));
        std::fs::remove_file(path).unwrap();
    }
}
