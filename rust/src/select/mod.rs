//! Node selection: one small trait, one file per policy.

mod round_robin;

use std::sync::Arc;

pub use round_robin::RoundRobin;

use crate::error::{Error, Kind, Result};
use crate::node::Node;
use crate::registry::{NoCandidates, NodeSet};

/// A routing policy picks one node among the eligible candidates.
pub trait Policy: Send + Sync + std::fmt::Debug {
    /// The name users configure (`--policy NAME`).
    fn name(&self) -> &'static str;
    /// Index into `candidates` (never empty) of the chosen node.
    fn pick(&self, candidates: &[Arc<Node>]) -> usize;
}

/// Builds a policy from its configured name.
pub fn policy_from_name(name: &str) -> Result<Box<dyn Policy>> {
    match name {
        "round_robin" => Ok(Box::new(RoundRobin::default())),
        other => Err(Error::new(Kind::InvalidRequest, format!("unknown routing policy {other:?}; known: round_robin"))),
    }
}

/// Selects a node for `model` from the current table.
pub fn select(set: &NodeSet, model: Option<&str>, policy: &dyn Policy) -> Result<Arc<Node>> {
    match set.candidates(model) {
        Ok(candidates) => Ok(Arc::clone(&candidates[policy.pick(candidates)])),
        Err(NoCandidates::NoNodes) => Err(Error::new(Kind::NoNodes, "no node is registered")),
        Err(NoCandidates::ModelNotFound) => {
            Err(Error::new(Kind::ModelNotFound, format!("the model `{}` does not exist", model.unwrap_or_default())))
        }
    }
}
