//! The node table: an immutable snapshot swapped atomically. Readers never lock; writers
//! (rare: add, remove) serialise on a mutex and publish a new snapshot.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use arc_swap::{ArcSwap, Guard};

use crate::error::{Error, Kind, Result};
use crate::node::{Node, NodeCounters, NodeUrl};

/// One published version of the node table, indexed for selection.
#[derive(Debug, Default)]
pub struct NodeSet {
    nodes: Vec<Arc<Node>>,
    /// Per model: the nodes that declare it, followed by the nodes whose models are unknown.
    by_model: HashMap<String, Vec<Arc<Node>>>,
    /// Nodes whose models are unknown: eligible for any model.
    wildcard: Vec<Arc<Node>>,
}

/// Why a request has no candidate node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoCandidates {
    NoNodes,
    ModelNotFound,
}

impl NodeSet {
    fn build(nodes: Vec<Arc<Node>>) -> Self {
        let wildcard: Vec<_> = nodes.iter().filter(|n| n.models().is_empty()).cloned().collect();
        let mut by_model: HashMap<String, Vec<Arc<Node>>> = HashMap::new();
        for node in &nodes {
            for model in node.models() {
                let list = by_model.entry(model.clone()).or_default();
                if !list.iter().any(|n| Arc::ptr_eq(n, node)) {
                    list.push(Arc::clone(node));
                }
            }
        }
        for list in by_model.values_mut() {
            list.extend(wildcard.iter().cloned());
        }
        Self { nodes, by_model, wildcard }
    }

    pub fn nodes(&self) -> &[Arc<Node>] {
        &self.nodes
    }

    pub fn get(&self, url: &str) -> Option<&Arc<Node>> {
        self.nodes.iter().find(|n| n.url() == url)
    }

    /// The nodes that may serve `model` (any node when the request names none).
    pub fn candidates(&self, model: Option<&str>) -> Result<&[Arc<Node>], NoCandidates> {
        if self.nodes.is_empty() {
            return Err(NoCandidates::NoNodes);
        }
        let list = match model {
            None => &self.nodes,
            Some(m) => self.by_model.get(m).unwrap_or(&self.wildcard),
        };
        if list.is_empty() {
            Err(NoCandidates::ModelNotFound)
        } else {
            Ok(list)
        }
    }

    /// Every model declared by some node, deduplicated, in registration order.
    pub fn models(&self) -> Vec<&str> {
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
    next_generation: AtomicU64,
    writer: Mutex<()>,
}

impl Registry {
    pub fn new() -> Self {
        Self::default()
    }

    /// The current table. Wait-free; hold it only for the duration of one selection.
    pub fn load(&self) -> Guard<Arc<NodeSet>> {
        self.snapshot.load()
    }

    /// Adds a node, or updates the models of an existing one (same generation and counters).
    pub fn add(&self, url: &str, models: Vec<String>) -> Result<Arc<Node>> {
        let url = NodeUrl::parse(url)?;
        let models = dedup(models);
        let _writer = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        let current = self.snapshot.load_full();
        let mut nodes = current.nodes.clone();
        let node = if let Some(pos) = nodes.iter().position(|n| n.url() == url.normalized) {
            let old = &nodes[pos];
            let updated = Arc::new(Node::new(&url, old.generation(), models, Arc::clone(old.counters())));
            nodes[pos] = Arc::clone(&updated);
            updated
        } else {
            let generation = self.next_generation.fetch_add(1, Ordering::Relaxed) + 1;
            let added = Arc::new(Node::new(&url, generation, models, Arc::new(NodeCounters::default())));
            nodes.push(Arc::clone(&added));
            added
        };
        self.snapshot.store(Arc::new(NodeSet::build(nodes)));
        Ok(node)
    }

    /// Removes a node from selection. Requests in flight keep their permits (and so their
    /// counts) until they end. Returns the removed node.
    pub fn remove(&self, url: &str) -> Result<Arc<Node>> {
        let url = NodeUrl::parse(url)?;
        let _writer = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        let current = self.snapshot.load_full();
        let Some(pos) = current.nodes.iter().position(|n| n.url() == url.normalized) else {
            return Err(Error::new(Kind::InvalidNode, format!("no node {} is registered", url.normalized)));
        };
        let mut nodes = current.nodes.clone();
        let removed = nodes.remove(pos);
        self.snapshot.store(Arc::new(NodeSet::build(nodes)));
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

    #[test]
    fn add_update_remove() {
        let reg = Registry::new();
        let a = reg.add("127.0.0.1:1", vec!["m".into()]).unwrap();
        let b = reg.add("http://127.0.0.1:2/", vec![]).unwrap();
        assert_ne!(a.generation(), b.generation());

        let updated = reg.add("http://127.0.0.1:1", vec!["m".into(), "n".into(), "m".into()]).unwrap();
        assert_eq!(updated.generation(), a.generation());
        assert!(Arc::ptr_eq(updated.counters(), a.counters()));
        assert_eq!(updated.models(), ["m", "n"]);
        assert_eq!(reg.load().nodes().len(), 2);

        reg.remove("127.0.0.1:1/").unwrap();
        assert_eq!(reg.remove("127.0.0.1:1").unwrap_err().kind(), Kind::InvalidNode);
        let again = reg.add("127.0.0.1:1", vec![]).unwrap();
        assert!(again.generation() > b.generation(), "re-adding starts a new generation");
        assert!(!Arc::ptr_eq(again.counters(), a.counters()));
    }

    #[test]
    fn candidates_by_model() {
        let reg = Registry::new();
        assert_eq!(reg.load().candidates(None).unwrap_err(), NoCandidates::NoNodes);
        reg.add("h:1", vec!["a".into()]).unwrap();
        reg.add("h:2", vec!["b".into()]).unwrap();
        let set = reg.load();
        assert_eq!(set.candidates(Some("a")).unwrap()[0].url(), "http://h:1");
        assert_eq!(set.candidates(None).unwrap().len(), 2);
        assert_eq!(set.candidates(Some("c")).unwrap_err(), NoCandidates::ModelNotFound);
        assert_eq!(set.models(), ["a", "b"]);

        reg.add("h:3", vec![]).unwrap();
        let set = reg.load();
        assert_eq!(set.candidates(Some("a")).unwrap().len(), 2, "unknown-model nodes serve any model");
        assert_eq!(set.candidates(Some("c")).unwrap()[0].url(), "http://h:3");
    }
}
