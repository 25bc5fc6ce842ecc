//! The routing policy of each role, and per-model overrides.

use rustc_hash::FxHashMap;
use std::sync::Arc;

use crate::node::Role;
use crate::select::kv_index::KvIndex;
use crate::select::{policy_from_spec, Policy, PolicySpec};

/// The policies to build: one per role, plus per-model overrides.
#[derive(Debug, Clone)]
pub struct RolePolicies {
    pub hybrid: PolicySpec,
    pub prefill: PolicySpec,
    pub decode: PolicySpec,
    pub by_model: Vec<(String, PolicySpec)>,
}

impl RolePolicies {
    /// `spec` for every role, and no per-model override.
    pub fn every_role(spec: PolicySpec) -> Self {
        Self { hybrid: spec, prefill: spec, decode: spec, by_model: Vec::new() }
    }
}

#[derive(Debug)]
pub(crate) struct PolicySet {
    /// Per role (`Role::index`).
    by_role: [Arc<dyn Policy>; 3],
    by_model: FxHashMap<String, Arc<dyn Policy>>,
}

impl PolicySet {
    /// The policies `specs` says; those that read the engines' reports ignore reports older than
    /// `engine_max_age_ms`.
    pub(crate) fn build(specs: &RolePolicies, engine_max_age_ms: u64) -> Self {
        let build = |spec: &PolicySpec| policy_from_spec(spec, engine_max_age_ms);
        let by_role = [build(&specs.hybrid), build(&specs.prefill), build(&specs.decode)];
        let by_model = specs.by_model.iter().map(|(model, spec)| (model.clone(), build(spec))).collect();
        Self { by_role, by_model }
    }

    pub(crate) fn for_request(&self, role: Role, model: Option<&str>) -> &Arc<dyn Policy> {
        if self.by_model.is_empty() {
            return &self.by_role[role.index()];
        }
        model.and_then(|m| self.by_model.get(m)).unwrap_or(&self.by_role[role.index()])
    }

    /// Every policy prices cache hits from `index` (see `Policy::use_kv_index`).
    pub(crate) fn use_kv_index(&self, index: Option<&Arc<KvIndex>>) {
        for policy in self.by_role.iter().chain(self.by_model.values()) {
            policy.use_kv_index(index.cloned());
        }
    }

    /// `(role, policy)` for each role, then `("model:NAME", policy)` for each override.
    pub(crate) fn names(&self) -> Vec<(String, &'static str)> {
        let mut out: Vec<(String, &'static str)> =
            Role::ALL.iter().map(|r| (r.name().to_owned(), self.by_role[r.index()].name())).collect();
        out.extend(self.by_model.iter().map(|(m, p)| (format!("model:{m}"), p.name())));
        out
    }
}
