//! Hybrid serving: one node per request, chosen by the routing policy, the request sent there
//! with retries and the node's answer relayed.

use super::pipeline::{Answer, Dispatch, Refused};
use crate::node::Role;

impl Dispatch<'_> {
    pub(super) async fn hybrid(&self) -> Result<Answer, Refused> {
        let engine = &self.worker.state.engine;
        let ctx = self.ctx(Role::Hybrid, None);
        let permit = engine.permit(&ctx).await?;
        let sent = engine.send(&self.worker.forwarder, permit, self.request, &ctx, true, true, self.deadline).await?;
        Ok(Answer::Relay { sent, session: None })
    }
}
