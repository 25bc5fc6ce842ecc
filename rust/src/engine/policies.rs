//! The routing policy of each role, and per-model overrides.

use rustc_hash::FxHashMap;
use std::sync::Arc;

use crate::error::{Error, Kind, Result};
use crate::node::Role;
use crate::select::kv_index::KvIndex;
use crate::select::{policy_from_name, Policy, PolicyConfig};

/// Names of the policies to build: one per role, plus `MODEL=POLICY` overrides.
#[derive(Debug, Clone, Default)]
pub struct PolicyNames {
    pub hybrid: String,
    pub prefill: String,
    pub decode: String,
    pub by_model: Vec<String>,
}

#[derive(Debug)]
pub(crate) struct PolicySet {
    /// Per role (`Role::index`).
    by_role: [Arc<dyn Policy>; 3],
    by_model: FxHashMap<String, Arc<dyn Policy>>,
}

impl PolicySet {
    pub(crate) fn build(names: &PolicyNames, config: &PolicyConfig) -> Result<Self> {
        let build = |name: &str| policy_from_name(name.trim(), config);
        let by_role = [build(&names.hybrid)?, build(&names.prefill)?, build(&names.decode)?];
        let mut by_model = FxHashMap::default();
        for entry in &names.by_model {
            let Some((model, name)) = entry.split_once('=') else {
                return Err(Error::new(Kind::Config, format!("model policy {entry:?} must read MODEL=POLICY")));
            };
            by_model.insert(model.trim().to_owned(), build(name)?);
        }
        Ok(Self { by_role, by_model })
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
