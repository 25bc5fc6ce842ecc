//! The only code that touches pyo3: the `pdproxy._pdproxy` extension module.

mod bridge;
mod config;
mod contracts;
mod distserve;
mod edge;
mod errors;
mod node;
mod pipeline;
mod replica_share;
mod response;
mod router;
mod shared;
mod tenants;
mod trace;

use pyo3::prelude::*;

#[pymodule(gil_used = false)]
fn _pdproxy(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // The routing policies by name: the kinds of the settings' policies (`pdproxy/config/policies.py`,
    // tested to be these, in this order), which `config` reads each role's policy by.
    m.add("POLICY_NAMES", pyo3::types::PyTuple::new(m.py(), crate::select::POLICY_NAMES)?)?;
    contracts::add(m)?;
    m.add_class::<router::Router>()?;
    m.add_class::<node::NodeView>()?;
    m.add_class::<node::EngineView>()?;
    m.add_class::<node::LearntView>()?;
    m.add_class::<node::HistogramsView>()?;
    m.add_class::<node::HistogramView>()?;
    m.add_class::<node::NodeAddressRules>()?;
    m.add_class::<response::Response>()?;
    m.add_class::<bridge::LoopBridge>()?;
    m.add_class::<shared::SharedTable>()?;
    m.add_class::<edge::EdgeListener>()?;
    m.add_class::<edge::Edge>()?;
    m.add_class::<trace::Trace>()?;
    m.add_class::<tenants::TenantTicket>()?;
    m.add_class::<distserve::DistServeCore>()?;
    m.add_class::<distserve::LinkDone>()?;
    m.add_class::<pipeline::Pipeline>()?;
    m.add_class::<replica_share::ReplicaShare>()?;
    Ok(())
}
