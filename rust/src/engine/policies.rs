//! The routing policy of each role, and per-model overrides.

use std::collections::HashMap;
use std::sync::Arc;

use crate::error::{Error, Kind, Result};
use crate::node::Role;
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
pub struct PolicySet {
    by_role: HashMap<Role, Arc<dyn Policy>>,
    by_model: HashMap<String, Arc<dyn Policy>>,
}

impl PolicySet {
    pub fn build(names: &PolicyNames, config: &PolicyConfig) -> Result<Self> {
        let build = |name: &str| policy_from_name(name.trim(), config);
        let by_role = HashMap::from([
            (Role::Hybrid, build(&names.hybrid)?),
            (Role::Prefill, build(&names.prefill)?),
            (Role::Decode, build(&names.decode)?),
        ]);
        let mut by_model = HashMap::new();
        for entry in &names.by_model {
            let Some((model, name)) = entry.split_once('=') else {
                return Err(Error::new(Kind::Config, format!("model policy {entry:?} must read MODEL=POLICY")));
            };
            by_model.insert(model.trim().to_owned(), build(name)?);
        }
        Ok(Self { by_role, by_model })
    }

    pub fn for_request(&self, role: Role, model: Option<&str>) -> &Arc<dyn Policy> {
        model.and_then(|m| self.by_model.get(m)).unwrap_or(&self.by_role[&role])
    }

    /// `(role, policy)` for each role, then `("model:NAME", policy)` for each override.
    pub fn names(&self) -> Vec<(String, &'static str)> {
        let mut out: Vec<(String, &'static str)> =
            Role::ALL.iter().map(|r| (r.name().to_owned(), self.by_role[r].name())).collect();
        out.extend(self.by_model.iter().map(|(m, p)| (format!("model:{m}"), p.name())));
        out
    }
}
