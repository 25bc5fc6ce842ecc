//! Selection and taking the node's permit are one step: a node raced to its cap is skipped and
//! the policy picks again.

use std::sync::Arc;

use super::admission::Admission;
use super::permit::InFlightPermit;
use crate::error::{Error, Kind, Result};
use crate::node::registry::{NoCandidates, NodeSet};
use crate::node::{Node, NodeState, Role};
use crate::observe::trace::SpanKind;
use crate::select::{Policy, SelectCtx};

/// Selects a node for the request and takes its permit.
pub fn select(
    set: &NodeSet,
    ctx: &SelectCtx<'_>,
    policy: &dyn Policy,
    admission: Option<&Arc<Admission>>,
) -> Result<InFlightPermit> {
    select_excluding(set, ctx, policy, admission, &[])
}

/// Like `select`, passing over the nodes of the given generations (those a retried request
/// already tried).
pub(crate) fn select_excluding(
    set: &NodeSet,
    ctx: &SelectCtx<'_>,
    policy: &dyn Policy,
    admission: Option<&Arc<Admission>>,
    exclude: &[u64],
) -> Result<InFlightPermit> {
    let Some(traced) = ctx.trace else {
        return pick(set, ctx, policy, admission, exclude).0;
    };
    let span = traced.open("pdproxy.select", SpanKind::Internal);
    let (selected, candidates) = pick(set, ctx, policy, admission, exclude);
    let attributes = || {
        let mut out =
            vec![("pdproxy.policy", policy.name().to_owned()), ("pdproxy.candidates", candidates.to_string())];
        if let Ok(permit) = &selected {
            out.push(("pdproxy.node", permit.node().url().to_owned()));
        }
        out
    };
    traced.trace.end(span, attributes, selected.as_ref().err().map(Error::message));
    selected
}

/// The selection, and how many candidates it chose from.
fn pick(
    set: &NodeSet,
    ctx: &SelectCtx<'_>,
    policy: &dyn Policy,
    admission: Option<&Arc<Admission>>,
    exclude: &[u64],
) -> (Result<InFlightPermit>, usize) {
    let all = match set.candidates(ctx.role, ctx.model) {
        Ok(candidates) => candidates,
        Err(NoCandidates::NoNodes) => {
            return (Err(Error::new(Kind::NoNodes, format!("no {} node is registered", ctx.role.name()))), 0);
        }
        Err(NoCandidates::ModelNotFound) => {
            let message = format!("the model `{}` does not exist", ctx.model.unwrap_or_default());
            return (Err(Error::new(Kind::ModelNotFound, message)), 0);
        }
        Err(NoCandidates::ModelsUnknown) => {
            let what = ctx.model.map_or_else(|| "this request".to_owned(), |m| format!("the model `{m}`"));
            let message = format!(
                "no {} node is known to serve {what} yet: some nodes' models are still being discovered",
                ctx.role.name()
            );
            return (Err(Error::new(Kind::NoHealthyNode, message)), 0);
        }
    };
    let kept: Vec<Arc<Node>>;
    let candidates = if exclude.is_empty() {
        all
    } else {
        kept = all.iter().filter(|n| !exclude.contains(&n.generation())).cloned().collect();
        &kept[..]
    };
    // A node that fills up between the policy's look and the permit is no longer available
    // at the next pick, so this ends within one round per candidate.
    for _ in 0..=candidates.len() {
        let Some(i) = policy.pick(candidates, ctx) else { break };
        if let Some(permit) = InFlightPermit::try_acquire(&candidates[i], admission) {
            // A stream's first byte, or a prefill leg's answer, is the first token.
            let timed = ctx.stream || ctx.role == Role::Prefill;
            permit.set_prediction(policy.selected(&candidates[i], ctx), timed);
            return (Ok(permit), candidates.len());
        }
    }
    let error =
        if candidates.iter().any(|n| n.counters().state() == NodeState::Healthy && n.counters().circuit.allows()) {
            Error::new(Kind::Overloaded, "every node that serves this request is at its concurrency limit")
        } else {
            Error::new(Kind::NoHealthyNode, "no healthy node serves this request now")
        };
    (Err(error), candidates.len())
}
