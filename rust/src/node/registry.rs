//! The node table: an immutable snapshot swapped atomically. Readers never lock; writers
//! (rare: add, update, remove) serialise on a mutex and publish a new snapshot.

use rustc_hash::FxHashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use arc_swap::{ArcSwap, Guard};

use crate::error::{Error, Kind, Result};
use crate::node::shared::SharedTable;
use crate::node::{Counters, Node, NodeSpec, NodeUrl, Role};

/// One published version of the node table, indexed for selection.
#[derive(Debug, Default)]
pub struct NodeSet {
    nodes: Vec<Arc<Node>>,
    /// Per role (`Role::index`).
    by_role: [RoleNodes; 3],
    /// Per role and model: the nodes known to serve it.
    by_model: [FxHashMap<String, Vec<Arc<Node>>>; 3],
    /// Requests received per declared model (the counters outlive the snapshot).
    tallies: Tallies,
}

/// Request counters by model: one per declared model, `other` for models no node declares
/// (so a client cannot grow the set), `none` for requests that name no model.
#[derive(Debug, Default, Clone)]
struct Tallies {
    by_model: FxHashMap<String, Arc<AtomicU64>>,
    other: Arc<AtomicU64>,
    none: Arc<AtomicU64>,
}

/// Per role: its nodes whose models are known (a node gets traffic only for the models it is
/// known to serve), and how many are still unknown (being discovered).
#[derive(Debug, Default)]
struct RoleNodes {
    known: Vec<Arc<Node>>,
    unknown: usize,
}

/// Why a request has no candidate node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NoCandidates {
    /// No node of the role is registered.
    NoNodes,
    ModelNotFound,
    /// No node is known to serve it, but some nodes' models are not known yet.
    ModelsUnknown,
}

impl NodeSet {
    fn build(nodes: Vec<Arc<Node>>, tallies: Tallies) -> Self {
        let mut by_role: [RoleNodes; 3] = Default::default();
        let mut by_model: [FxHashMap<String, Vec<Arc<Node>>>; 3] = Default::default();
        for node in &nodes {
            let entry = &mut by_role[node.role().index()];
            if node.models().is_empty() {
                entry.unknown += 1;
                continue;
            }
            entry.known.push(Arc::clone(node));
            for model in node.models() {
                by_model[node.role().index()].entry(model.clone()).or_default().push(Arc::clone(node));
            }
        }
        Self { nodes, by_role, by_model, tallies }
    }

    /// Counts one request for `model` (see `Registry::model_requests`).
    pub(crate) fn count_request(&self, model: Option<&str>) {
        let counter = match model {
            None => &self.tallies.none,
            Some(m) => self.tallies.by_model.get(m).unwrap_or(&self.tallies.other),
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn nodes(&self) -> &[Arc<Node>] {
        &self.nodes
    }

    pub(crate) fn get(&self, url: &str) -> Option<&Arc<Node>> {
        let url = NodeUrl::parse(url).ok()?;
        self.nodes.iter().find(|n| n.url() == url.normalized)
    }

    /// The nodes of `role` known to serve `model` (those whose models are known when the
    /// request names none).
    pub(crate) fn candidates(&self, role: Role, model: Option<&str>) -> Result<&[Arc<Node>], NoCandidates> {
        let nodes = &self.by_role[role.index()];
        let list = match model {
            None => Some(&nodes.known),
            Some(m) => self.by_model[role.index()].get(m),
        };
        match list {
            Some(list) if !list.is_empty() => Ok(list),
            _ if nodes.unknown > 0 => Err(NoCandidates::ModelsUnknown),
            _ if nodes.known.is_empty() => Err(NoCandidates::NoNodes),
            _ => Err(NoCandidates::ModelNotFound),
        }
    }

    /// Every model declared by some node, deduplicated, in registration order.
    pub(crate) fn models(&self) -> Vec<&str> {
        let mut seen = Vec::new();
        for model in self.nodes.iter().flat_map(|n| n.models()) {
            if !seen.contains(&model.as_str()) {
                seen.push(model.as_str());
            }
        }
        seen
    }
}

#[derive(Debug, Default)]
pub struct Registry {
    snapshot: ArcSwap<NodeSet>,
    /// Every request counter by model so far, kept across snapshots (writers only).
    tallies: Mutex<Tallies>,
    next_generation: AtomicU64,
    writer: Mutex<()>,
    /// In a worker group: the shared table that holds the counters, and this worker's index.
    group: Option<(Arc<SharedTable>, usize)>,
}

impl Registry {
    pub fn new() -> Self {
        Self::default()
    }

    /// A registry whose nodes' counters live in `table`, as worker `worker` of the group.
    pub(crate) fn in_group(table: Arc<SharedTable>, worker: usize) -> Self {
        Self { group: Some((table, worker)), ..Self::default() }
    }

    /// Whether the nodes' counters live in a worker group's shared table.
    pub(crate) fn in_a_group(&self) -> bool {
        self.group.is_some()
    }

    /// Fresh counters and a generation for a new registration of `url`: in a group, the
    /// shared slot bound to the URL (the same one every worker binds).
    fn fresh(&self, url: &NodeUrl) -> Result<(Counters, u64)> {
        if let Some((table, worker)) = &self.group {
            let binding = table.bind(&url.normalized)?;
            return Ok((Counters::shared(Arc::clone(table), binding, *worker), binding.1));
        }
        Ok((Counters::default(), self.next_generation.fetch_add(1, Ordering::Relaxed) + 1))
    }

    /// Whether a node's counters are still its registration's (in a group, another worker
    /// may have removed and re-added the URL since this one bound it).
    fn is_current(&self, node: &Node) -> bool {
        match (&self.group, node.counters().binding()) {
            (Some((table, _)), Some(binding)) => table.is_current(binding),
            _ => true,
        }
    }

    /// Rebinds nodes whose shared slot was retired by another worker; returns how many.
    pub(crate) fn refresh_bindings(&self) -> Result<usize> {
        let stale: Vec<Arc<Node>> = self.load().nodes().iter().filter(|n| !self.is_current(n)).cloned().collect();
        for node in &stale {
            self.add(node.url(), node.spec().clone())?;
        }
        Ok(stale.len())
    }

    /// Publishes a new table of `nodes`. Called with the writer lock held.
    fn publish(&self, nodes: Vec<Arc<Node>>) {
        let mut all = self.tallies.lock().unwrap_or_else(PoisonError::into_inner);
        let mut tallies =
            Tallies { by_model: FxHashMap::default(), other: Arc::clone(&all.other), none: Arc::clone(&all.none) };
        for model in nodes.iter().flat_map(|n| n.models()) {
            let counter = all.by_model.entry(model.clone()).or_default();
            tallies.by_model.insert(model.clone(), Arc::clone(counter));
        }
        drop(all);
        self.snapshot.store(Arc::new(NodeSet::build(nodes, tallies)));
    }

    /// Requests received per model since the start: every model some node declared, plus
    /// `other` and `none`.
    pub fn model_requests(&self) -> Vec<(String, u64)> {
        let all = self.tallies.lock().unwrap_or_else(PoisonError::into_inner);
        let mut out: Vec<(String, u64)> =
            all.by_model.iter().map(|(m, c)| (m.clone(), c.load(Ordering::Relaxed))).collect();
        out.push(("other".to_owned(), all.other.load(Ordering::Relaxed)));
        out.push(("none".to_owned(), all.none.load(Ordering::Relaxed)));
        out.retain(|(_, n)| *n > 0);
        out.sort();
        out
    }

    /// The current table. Wait-free; hold it only for the duration of one selection.
    pub fn load(&self) -> Guard<Arc<NodeSet>> {
        self.snapshot.load()
    }

    /// Adds a node, or updates the spec of a registered one (same generation and counters).
    pub fn add(&self, url: &str, spec: NodeSpec) -> Result<Arc<Node>> {
        Ok(self.add_parsed(&NodeUrl::parse(url)?, spec)?.0)
    }

    /// `add` for a URL parsed already; also says whether the node is new.
    pub(crate) fn add_parsed(&self, url: &NodeUrl, spec: NodeSpec) -> Result<(Arc<Node>, bool)> {
        spec.check()?;
        let spec = NodeSpec { models: dedup(spec.models), ..spec };
        let _writer = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        let current = self.snapshot.load_full();
        let mut nodes = current.nodes.clone();
        let node = if let Some(pos) = nodes.iter().position(|n| n.url() == url.normalized) {
            let old = &nodes[pos];
            let (counters, generation) =
                if self.is_current(old) { (old.counters().clone(), old.generation()) } else { self.fresh(url)? };
            let updated = Arc::new(Node::new(url, generation, spec, counters));
            nodes[pos] = Arc::clone(&updated);
            (updated, false)
        } else {
            let (counters, generation) = self.fresh(url)?;
            let added = Arc::new(Node::new(url, generation, spec, counters));
            nodes.push(Arc::clone(&added));
            (added, true)
        };
        self.publish(nodes);
        Ok(node)
    }

    /// Changes one registered node's spec in place (same generation and counters).
    pub(crate) fn update(&self, url: &str, change: impl FnOnce(&mut NodeSpec)) -> Result<Arc<Node>> {
        let url = NodeUrl::parse(url)?;
        let _writer = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        let current = self.snapshot.load_full();
        let Some(pos) = current.nodes.iter().position(|n| n.url() == url.normalized) else {
            return Err(Error::new(Kind::NodeNotFound, format!("no node {} is registered", url.normalized)));
        };
        let old = &current.nodes[pos];
        let mut spec = old.spec().clone();
        change(&mut spec);
        spec.models = dedup(spec.models);
        let updated = Arc::new(Node::new(&url, old.generation(), spec, old.counters().clone()));
        let mut nodes = current.nodes.clone();
        nodes[pos] = Arc::clone(&updated);
        self.publish(nodes);
        Ok(updated)
    }

    /// Removes a node from selection. Requests in flight keep their permits (and so their
    /// counts) until they end. Returns the removed node.
    pub(crate) fn remove(&self, url: &str) -> Result<Arc<Node>> {
        let url = NodeUrl::parse(url)?;
        let _writer = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        let current = self.snapshot.load_full();
        let Some(pos) = current.nodes.iter().position(|n| n.url() == url.normalized) else {
            return Err(Error::new(Kind::NodeNotFound, format!("no node {} is registered", url.normalized)));
        };
        let mut nodes = current.nodes.clone();
        let removed = nodes.remove(pos);
        self.publish(nodes);
        if let (Some((table, _)), Some(binding)) = (&self.group, removed.counters().binding()) {
            table.retire(binding);
        }
        Ok(removed)
    }
}

fn dedup(models: Vec<String>) -> Vec<String> {
    let mut out: Vec<String> = Vec::with_capacity(models.len());
    for m in models {
        if !out.contains(&m) {
            out.push(m);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(models: &[&str], role: Role) -> NodeSpec {
        NodeSpec { models: models.iter().map(|m| (*m).to_owned()).collect(), role, ..NodeSpec::default() }
    }

    #[test]
    fn add_update_remove() {
        let reg = Registry::new();
        let a = reg.add("127.0.0.1:1", spec(&["m"], Role::Hybrid)).unwrap();
        let b = reg.add("http://127.0.0.1:2/", spec(&[], Role::Hybrid)).unwrap();
        assert_ne!(a.generation(), b.generation());

        let updated = reg.add("http://127.0.0.1:1", spec(&["m", "n", "m"], Role::Hybrid)).unwrap();
        assert_eq!(updated.generation(), a.generation());
        assert!(updated.counters().same(a.counters()));
        assert_eq!(updated.models(), ["m", "n"]);
        assert_eq!(reg.load().nodes().len(), 2);

        reg.remove("127.0.0.1:1/").unwrap();
        assert_eq!(reg.remove("127.0.0.1:1").unwrap_err().kind(), Kind::NodeNotFound);
        let again = reg.add("127.0.0.1:1", spec(&[], Role::Hybrid)).unwrap();
        assert!(again.generation() > b.generation(), "re-adding starts a new generation");
        assert!(!again.counters().same(a.counters()), "remove-then-add does not mix counts");
        assert!(reg.add("h:9", NodeSpec { speed: Some(-1.0), ..NodeSpec::default() }).is_err());
    }

    #[test]
    fn workers_of_a_group_share_counters_and_rebind_after_a_removal() {
        let path = std::env::temp_dir().join(format!("pdproxy-registry-test-{}", std::process::id()));
        let table = Arc::new(SharedTable::create(&path).unwrap());
        let (one, two) = (Registry::in_group(Arc::clone(&table), 0), Registry::in_group(Arc::clone(&table), 1));
        let a = one.add("h:1", spec(&[], Role::Hybrid)).unwrap();
        let b = two.add("http://h:1/", spec(&[], Role::Hybrid)).unwrap();
        assert!(a.counters().same(b.counters()) && a.generation() == b.generation());

        one.remove("h:1").unwrap();
        let again = one.add("h:1", spec(&[], Role::Hybrid)).unwrap();
        assert!(again.generation() > a.generation());
        assert_eq!(two.refresh_bindings().unwrap(), 1, "worker two still held the retired slot");
        let rebound = two.load().get("h:1").cloned().unwrap();
        assert!(rebound.counters().same(again.counters()));
        assert_eq!(two.refresh_bindings().unwrap(), 0);
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn candidates_by_role_and_model() {
        let reg = Registry::new();
        assert_eq!(reg.load().candidates(Role::Hybrid, None).unwrap_err(), NoCandidates::NoNodes);
        reg.add("h:1", spec(&["a"], Role::Hybrid)).unwrap();
        reg.add("h:2", spec(&["b"], Role::Hybrid)).unwrap();
        reg.add("h:3", spec(&["a"], Role::Prefill)).unwrap();
        let set = reg.load();
        assert_eq!(set.candidates(Role::Hybrid, Some("a")).unwrap().len(), 1);
        assert_eq!(set.candidates(Role::Prefill, Some("a")).unwrap()[0].url(), "http://h:3");
        assert_eq!(set.candidates(Role::Hybrid, None).unwrap().len(), 2);
        assert_eq!(set.candidates(Role::Hybrid, Some("c")).unwrap_err(), NoCandidates::ModelNotFound);
        assert_eq!(set.candidates(Role::Decode, Some("a")).unwrap_err(), NoCandidates::NoNodes);
        assert_eq!(set.models(), ["a", "b"]);

        reg.add("h:4", spec(&[], Role::Hybrid)).unwrap();
        let set = reg.load();
        assert_eq!(set.candidates(Role::Hybrid, Some("a")).unwrap().len(), 1, "no traffic before its models are known");
        assert_eq!(set.candidates(Role::Hybrid, None).unwrap().len(), 2);
        assert_eq!(set.candidates(Role::Hybrid, Some("c")).unwrap_err(), NoCandidates::ModelsUnknown);
        reg.add("h:5", spec(&[], Role::Decode)).unwrap();
        assert_eq!(reg.load().candidates(Role::Decode, None).unwrap_err(), NoCandidates::ModelsUnknown);
    }
}
