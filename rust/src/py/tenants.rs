//! Tenants for the control plane: the tenants file's entries in, a request's admission as a
//! `TenantTicket`, and each tenant's counts and window out (for `/metrics` and `/usage`).

use std::sync::{Arc, Mutex, PoisonError};

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::headers::header_pairs;
use crate::tenants::Class;
use crate::tenants::{Limit, Limited, Limits, Tenant, TenantPass, TenantSpec};

pyo3::import_exception!(pdproxy.errors, RateLimited);
pyo3::import_exception!(pdproxy.errors, QuotaExceeded);

/// One entry of the tenants file, as `pdproxy/server/tenants.py` reads it.
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
pub(crate) struct TenantEntry {
    name: String,
    keys: Vec<String>,
    rpm: Option<u64>,
    tpm: Option<u64>,
    concurrency: Option<u32>,
    daily_tokens: Option<u64>,
    priority: i32,
    priority_limit: i32,
}

impl From<TenantEntry> for TenantSpec {
    fn from(entry: TenantEntry) -> Self {
        let TenantEntry { name, keys, rpm, tpm, concurrency, daily_tokens, priority, priority_limit } = entry;
        TenantSpec { name, keys, limits: Limits { rpm, tpm, concurrency, daily_tokens, priority, priority_limit } }
    }
}

/// A request's admission: its queue class, and its tenant's pass when it has a tenant (shared
/// with the forwarding task, which counts the answer's tokens; settled when both let go).
#[pyclass(frozen, name = "TenantTicket", module = "pdproxy._pdproxy")]
pub(crate) struct TenantTicket {
    pub(crate) pass: Arc<Mutex<Option<TenantPass>>>,
    pub(crate) class: Class,
    tenant: Option<String>,
    headers: Vec<(Vec<u8>, Vec<u8>)>,
}

impl TenantTicket {
    pub(crate) fn new(pass: Option<TenantPass>, class: Class) -> Self {
        let headers = pass.as_ref().map_or_else(Vec::new, |p| header_pairs(p.headers.to_headers()));
        let tenant = pass.as_ref().map(|p| p.tenant().name.clone());
        Self { pass: Arc::new(Mutex::new(pass)), class, tenant, headers }
    }
}

#[pymethods]
impl TenantTicket {
    /// The tenant's name (`None`: a request of no tenant).
    #[getter]
    fn tenant(&self) -> Option<&str> {
        self.tenant.as_deref()
    }

    #[getter]
    fn priority(&self) -> i32 {
        self.class.priority
    }

    /// The tenant's `x-ratelimit-*` headers at admission, for the answer.
    #[getter]
    fn headers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.headers.iter().map(|(n, v)| (PyBytes::new(py, n), PyBytes::new(py, v))))
    }

    /// The request failed (counted in the tenant's errors).
    fn fail(&self) {
        if let Some(pass) = self.pass.lock().unwrap_or_else(PoisonError::into_inner).as_mut() {
            pass.fail();
        }
    }

    /// Settles the pass now (the request has ended): its slot is given back, its tokens counted.
    fn close(&self) {
        drop(self.pass.lock().unwrap_or_else(PoisonError::into_inner).take());
    }
}

/// A tenant over a limit, as the exception the control plane answers with.
pub(crate) fn limited_to_pyerr(limited: &Limited) -> PyErr {
    let args = (
        limited.message.clone(),
        None::<String>,
        limited.retry_after,
        limited.limit.name(),
        header_pairs(limited.headers.to_headers()),
    );
    if limited.limit == Limit::Budget {
        QuotaExceeded::new_err(args)
    } else {
        RateLimited::new_err(args)
    }
}

/// One tenant's limits, window, in-flight requests and counts.
pub(crate) fn tenant_dict<'py>(py: Python<'py>, tenant: &Tenant) -> PyResult<Bound<'py, PyDict>> {
    use std::sync::atomic::Ordering::Relaxed;
    let out = PyDict::new(py);
    let limits = tenant.limits();
    let (window, today) = tenant.window();
    let stats = &tenant.stats;
    out.set_item("name", &tenant.name)?;
    let limits_dict = PyDict::new(py);
    limits_dict.set_item("rpm", limits.rpm)?;
    limits_dict.set_item("tpm", limits.tpm)?;
    limits_dict.set_item("concurrency", limits.concurrency)?;
    limits_dict.set_item("daily_tokens", limits.daily_tokens)?;
    limits_dict.set_item("priority", limits.priority)?;
    limits_dict.set_item("priority_limit", limits.priority_limit)?;
    out.set_item("limits", limits_dict)?;
    for (name, values) in [("requests", window.requests), ("tokens", window.tokens)] {
        let entry = values.map(|(limit, remaining, reset)| {
            let d = PyDict::new(py);
            d.set_item("limit", limit)?;
            d.set_item("remaining", remaining)?;
            d.set_item("reset_seconds", reset)?;
            Ok::<_, PyErr>(d)
        });
        out.set_item(name, entry.transpose()?)?;
    }
    out.set_item("tokens_today", today)?;
    out.set_item("in_flight", tenant.in_flight.load(Relaxed))?;
    out.set_item("total_requests", stats.requests.load(Relaxed))?;
    out.set_item("errors", stats.errors.load(Relaxed))?;
    out.set_item("prompt_tokens", stats.prompt_tokens.load(Relaxed))?;
    out.set_item("completion_tokens", stats.completion_tokens.load(Relaxed))?;
    out.set_item("estimated", stats.estimated.load(Relaxed))?;
    let rejected = PyDict::new(py);
    for limit in [Limit::Requests, Limit::Tokens, Limit::Concurrency, Limit::Budget] {
        rejected.set_item(limit.name(), stats.rejected[limit as usize].load(Relaxed))?;
    }
    out.set_item("rejected", rejected)?;
    Ok(out)
}
