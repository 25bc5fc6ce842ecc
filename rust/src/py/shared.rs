//! `SharedTable`: the worker group's table of node counters, for the control plane that
//! creates it (`pdproxy serve`), attaches workers to it and looks after it (the leader).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::node::shared;

#[pyclass(frozen, name = "SharedTable", module = "pdproxy._pdproxy")]
pub(crate) struct SharedTable {
    pub(crate) inner: Arc<shared::SharedTable>,
}

#[pymethods]
impl SharedTable {
    /// Node slots per table.
    #[classattr]
    const SLOTS: usize = shared::SLOTS;
    /// Worker entries per table.
    #[classattr]
    const MAX_WORKERS: usize = shared::MAX_WORKERS;

    /// Creates a new table file at `path` (it must not exist).
    #[staticmethod]
    fn create(path: PathBuf) -> PyResult<Self> {
        Ok(Self { inner: Arc::new(shared::SharedTable::create(&path)?) })
    }

    /// Maps the table file at `path`.
    #[staticmethod]
    fn open(path: PathBuf) -> PyResult<Self> {
        Ok(Self { inner: Arc::new(shared::SharedTable::open(&path)?) })
    }

    /// Attaches the worker process `pid`; returns its index.
    fn join(&self, pid: u32) -> PyResult<usize> {
        Ok(self.inner.join(pid)?)
    }

    /// Attached workers as (index, pid).
    fn workers(&self) -> Vec<(usize, u32)> {
        self.inner.workers()
    }

    /// The permits worker `index` holds now.
    fn held(&self, index: usize) -> u64 {
        self.inner.held(index)
    }

    /// Detaches a worker that has exited, handing back the permits it held; returns how many,
    /// or None when the entry is no longer `pid`'s.
    fn reclaim(&self, index: usize, pid: u32) -> Option<u64> {
        self.inner.reclaim(index, pid)
    }

    /// Frees retired slots idle for at least `grace` seconds; returns how many.
    fn recycle(&self, grace: f64) -> PyResult<usize> {
        let grace = Duration::try_from_secs_f64(grace).map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(self.inner.recycle(grace))
    }

    /// (bound, retired) slots.
    fn slots_in_use(&self) -> (usize, usize) {
        self.inner.slots_in_use()
    }

    /// Bumped after every membership change.
    #[getter]
    fn epoch(&self) -> u64 {
        self.inner.epoch()
    }

    fn bump_epoch(&self) -> u64 {
        self.inner.bump_epoch()
    }

    /// Whether the group was asked to drain.
    #[getter]
    fn draining(&self) -> bool {
        self.inner.draining()
    }

    fn set_draining(&self) {
        self.inner.set_draining();
    }
}
