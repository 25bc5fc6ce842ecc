//! Hybrid serving: one node per request, chosen by the routing policy, the request sent there
//! with retries and the node's answer relayed.

use super::pipeline::{Answer, Dispatch, Refused};
use crate::engine::HeldPermit;
use crate::node::Role;

impl Dispatch<'_> {
    pub(super) async fn hybrid(&self) -> Result<Answer, Refused> {
        let engine = &self.worker.state.engine;
        let ctx = self.ctx(Role::Hybrid, None);
        let held = HeldPermit::default();
        let permit = engine.permit(&ctx).await?;
        let (node, response) =
            engine.send(&self.worker.forwarder, permit, self.request, &ctx, true, true, &held).await?;
        Ok(Answer::Relay { node, response, held, session: None })
    }
}
