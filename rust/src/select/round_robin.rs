//! `round_robin`: each candidate in turn.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::Policy;
use crate::node::Node;

#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn pick(&self, candidates: &[Arc<Node>]) -> usize {
        self.next.fetch_add(1, Ordering::Relaxed) % candidates.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::Registry;
    use crate::select::select;

    #[test]
    fn cycles_through_candidates() {
        let reg = Registry::new();
        for port in 1..=3 {
            reg.add(&format!("h:{port}"), vec!["m".into()]).unwrap();
        }
        let policy = RoundRobin::default();
        let picks: Vec<String> =
            (0..6).map(|_| select(&reg.load(), Some("m"), &policy).unwrap().url().to_owned()).collect();
        assert_eq!(picks, ["http://h:1", "http://h:2", "http://h:3", "http://h:1", "http://h:2", "http://h:3"]);
    }
}
