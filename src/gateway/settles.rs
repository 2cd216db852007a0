//! Settles routed by lease id: which served consumer an id names (a version 3 id by its
//! names, binding an existing consumer only for a genuine id; a version 2 id by whichever
//! consumer signed it), whether the caller may settle there (404 for a forged id whoever
//! asks, 403 otherwise), and a batch split among the consumers its ids name.
//!
//! May import: as the rest of `gateway`.

use std::sync::Arc;

use futures::future::join_all;
use time::OffsetDateTime;

use super::registry::Served;
use super::{Gateway, May, SettleResult};
use crate::domain::consumers::ConsumerName;
use crate::domain::lease_id::named_in;
use crate::domain::settle::AckCommand;
use crate::error::Error;

impl Gateway {
    /// The consumer a lease id names: a version 3 id by its names, a version 2 id (the
    /// default consumer's, or an earlier release's) by whichever served consumer signed it.
    async fn served_for_lease(&self, id: &str, may: May<'_>) -> Result<Arc<Served>, Error> {
        if let Some((stream, consumer)) = named_in(id) {
            let name = ConsumerName::new(&stream, &consumer);
            return match self.0.registry.get(&name) {
                Some(served) => Some(served),
                // Only a genuine id binds its consumer: a forged one (naming any consumer it
                // likes) costs no server lookup, and tells nothing of which consumers exist.
                None if self
                    .0
                    .process
                    .signer(&stream, &consumer)
                    .decode(id)
                    .is_some() =>
                {
                    // Not bound for a caller who may not settle there (403 without a bind).
                    if !may(&name) {
                        return Err(Error::Forbidden { scope: "settle" });
                    }
                    Box::pin(self.bind_existing(&name)).await.ok()
                }
                None => None,
            }
            .ok_or(Error::UnknownLease);
        }
        if let Some(served) = self.0.registry.default_consumer() {
            return Ok(served);
        }
        self.0
            .registry
            .all()
            .into_iter()
            .map(|(_, served)| served)
            .find(|served| served.consumer.signed(id))
            .ok_or(Error::UnknownLease)
    }

    /// The consumer a lease id names, if the caller `may` settle there: 404 for an id of
    /// no served consumer, 403 for one of a consumer the caller's token does not reach.
    async fn lease_for(&self, id: &str, may: May<'_>) -> Result<Arc<Served>, Error> {
        let served = self.served_for_lease(id, may).await?;
        if !may(served.consumer.name()) {
            // A forged id is a 404 whoever asks: a 403 would confirm the consumer it names.
            // (Looked at only here: a settle the caller may make verifies its id anyway.)
            if !served.consumer.signed(id) {
                return Err(Error::UnknownLease);
            }
            return Err(Error::Forbidden { scope: "settle" });
        }
        served.touch();
        Ok(served)
    }

    /// Ack, nak or term one lease, on the consumer its id names.
    pub(crate) async fn settle(
        &self,
        id: &str,
        command: &AckCommand,
        may: May<'_>,
    ) -> SettleResult {
        let served = self.lease_for(id, may).await?;
        served.consumer.settle(id, command).await
    }

    /// Settle every id on the consumer it names, consumers concurrently; the results in the
    /// order of `ids`.
    pub(crate) async fn settle_many(
        &self,
        ids: &[String],
        command: &AckCommand,
        may: May<'_>,
    ) -> Vec<SettleResult> {
        // One id (a WebSocket client acking each message): the single settle's path.
        if let [id] = ids {
            let settled = match self.lease_for(id, may).await {
                Ok(served) => served.consumer.settle(id, command).await,
                Err(err) => Err(err),
            };
            return vec![settled];
        }
        // Boxed, so that the one-id path's future (a WebSocket operation's task) does not
        // carry the batch path's state.
        Box::pin(self.settle_by_consumer(ids, command, may)).await
    }

    /// [`Gateway::settle_many`] of more than one id: grouped by the consumer each names.
    async fn settle_by_consumer(
        &self,
        ids: &[String],
        command: &AckCommand,
        may: May<'_>,
    ) -> Vec<SettleResult> {
        let mut groups: Vec<(Arc<Served>, Vec<usize>)> = Vec::new();
        let mut results: Vec<Option<SettleResult>> = vec![None; ids.len()];
        for (at, id) in ids.iter().enumerate() {
            match self.lease_for(id, may).await {
                Ok(served) => match groups
                    .iter_mut()
                    .find(|(group, _)| Arc::ptr_eq(group, &served))
                {
                    Some((_, positions)) => positions.push(at),
                    None => groups.push((served, vec![at])),
                },
                Err(err) => results[at] = Some(Err(err)),
            }
        }
        // All of one consumer (the common batch): no copy of the ids.
        if let [(served, positions)] = groups.as_slice()
            && positions.len() == ids.len()
        {
            return served.consumer.settle_many(ids, command).await;
        }
        let settled = join_all(groups.iter().map(|(served, positions)| async move {
            let ids: Vec<String> = positions.iter().map(|at| ids[*at].clone()).collect();
            served.consumer.settle_many(&ids, command).await
        }))
        .await;
        for ((_, positions), outcomes) in groups.iter().zip(settled) {
            for (at, outcome) in positions.iter().zip(outcomes) {
                results[*at] = Some(outcome);
            }
        }
        results
            .into_iter()
            .map(|result| result.unwrap_or(Err(Error::UnknownLease)))
            .collect()
    }

    /// Extend one lease by the consumer's ack_wait.
    pub(crate) async fn extend(&self, id: &str, may: May<'_>) -> Result<OffsetDateTime, Error> {
        let served = self.lease_for(id, may).await?;
        served.consumer.extend(id).await
    }
}
