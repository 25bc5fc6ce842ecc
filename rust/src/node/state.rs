//! Whether a node may take new requests.

use crate::error::{Error, Kind, Result};

/// Whether a node may take new requests. Only `Healthy` nodes are selected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum NodeState {
    Healthy = 0,
    Unhealthy = 1,
    /// Finishing its requests; takes no new ones.
    Draining = 2,
    /// Up but not serving (an LMDeploy engine put to sleep).
    Sleeping = 3,
    /// Starting up: not serving yet.
    Initializing = 4,
}

impl NodeState {
    pub(crate) fn parse(raw: &str) -> Result<Self> {
        match raw.trim().to_ascii_lowercase().as_str() {
            "healthy" => Ok(NodeState::Healthy),
            "unhealthy" => Ok(NodeState::Unhealthy),
            "draining" => Ok(NodeState::Draining),
            "sleeping" => Ok(NodeState::Sleeping),
            "initializing" => Ok(NodeState::Initializing),
            _ => Err(Error::new(
                Kind::InvalidNode,
                format!("unknown node state {raw:?}: use healthy, unhealthy, draining, sleeping or initializing"),
            )),
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            NodeState::Healthy => "healthy",
            NodeState::Unhealthy => "unhealthy",
            NodeState::Draining => "draining",
            NodeState::Sleeping => "sleeping",
            NodeState::Initializing => "initializing",
        }
    }

    pub(super) fn from_u8(raw: u8) -> Self {
        match raw {
            0 => NodeState::Healthy,
            1 => NodeState::Unhealthy,
            2 => NodeState::Draining,
            3 => NodeState::Sleeping,
            _ => NodeState::Initializing,
        }
    }
}
