//! Where a published message goes, and publishing it: a served consumer's stream that
//! captures the subject, else (with `--serve-existing`) the stream on the server that does.
//!
//! May import: as the rest of `gateway`.

use std::collections::HashMap;
use std::sync::Arc;

use async_nats::jetstream::publish::PublishAck;
use futures::future::join_all;

use super::consumer::publish_refusal;
use super::registry::Served;
use super::{Gateway, Source};
use crate::error::Error;
use crate::nats::publish::{BatchAck, Route};

impl Gateway {
    /// Publish to whichever served stream captures `subject`, and wait until it is stored.
    pub(crate) async fn publish(
        &self,
        subject: String,
        headers: async_nats::HeaderMap,
        payload: bytes::Bytes,
    ) -> Result<async_nats::jetstream::publish::PublishAck, Error> {
        self.send_publish(subject, headers, payload)
            .await?
            .confirmed()
            .await
            .map_err(publish_refusal)
    }

    /// Send a message to whichever served stream captures `subject`, not waiting for the
    /// stream's acknowledgement (a batch sends all its messages first).
    pub(crate) async fn send_publish(
        &self,
        subject: String,
        headers: async_nats::HeaderMap,
        payload: bytes::Bytes,
    ) -> Result<crate::nats::publish::SentPublish, Error> {
        self.publish_route(&subject)
            .await?
            .send(subject, headers, payload)
            .await
            .map_err(publish_refusal)
    }

    /// The stream a message to `subject` goes to: a served consumer's stream that captures
    /// it, else (with `--serve-existing`) the stream on the server that does.
    pub(crate) async fn publish_route(&self, subject: &str) -> Result<Route, Error> {
        let mut served: Vec<Arc<Served>> = self
            .0
            .registry
            .all()
            .into_iter()
            .map(|(_, served)| served)
            .filter(|served| !served.is_retired())
            .collect();
        // The default consumer first: its stream's error is the one a single-consumer
        // gateway has always answered.
        served.sort_by_key(|served| served.source != Source::Default);
        let mut first_refusal = None;
        for served in &served {
            match served.consumer.captures(subject) {
                Ok(true) => return served.consumer.publish_route(subject),
                Ok(false) => {}
                Err(err) => {
                    first_refusal.get_or_insert(err);
                }
            }
        }
        if let Some(err) = first_refusal {
            return Err(err);
        }
        // A stream --serve-existing names: bound or not, so one rule holds for it (a
        // stream's publishers should not depend on whether one of its consumers is idle).
        if let Some(patterns) = &self.config().serve_existing
            && let Some(client) = self.0.process.connection.get()
        {
            let js = async_nats::jetstream::new(client);
            let stream = crate::nats::publish::stream_capturing(&js, subject)
                .await
                .map_err(publish_refusal)?;
            if let Some(stream) = stream.filter(|stream| patterns.matches_stream(stream)) {
                return Ok(Route::looked_up(js, stream, self.config().settle_timeout));
            }
        }
        let Some(first) = served.first() else {
            return Err(Error::invalid(
                "subject",
                "this gateway serves no consumer yet, so no stream to publish to",
            ));
        };
        // No stream captures it: the default consumer's own error names its subjects.
        first.consumer.publish_route(subject)
    }
}

/// A message ready to publish: its subject, headers and payload.
pub(crate) type Outgoing = (String, async_nats::HeaderMap, bytes::Bytes);

/// The first nats-server with atomic batches.
const ATOMIC_SINCE: (u64, u64) = (2, 12);

impl Gateway {
    /// Publish many messages: every one is sent before any acknowledgement is awaited (one
    /// round trip for them all; the stream stores them in this order). A refused message
    /// (`Err` already, or refused by its stream) does not stop the others.
    pub(crate) async fn publish_many(
        &self,
        messages: Vec<Result<Outgoing, Error>>,
    ) -> Vec<Result<PublishAck, Error>> {
        let mut routes: HashMap<String, Route> = HashMap::new();
        let mut sent = Vec::with_capacity(messages.len());
        for message in messages {
            let (subject, headers, payload) = match message {
                Ok(message) => message,
                Err(refused) => {
                    sent.push(Err(refused));
                    continue;
                }
            };
            let route = match routes.get(&subject) {
                Some(route) => Ok(route.clone()),
                None => self.publish_route(&subject).await.inspect(|route| {
                    routes.insert(subject.clone(), route.clone());
                }),
            };
            sent.push(match route {
                Ok(route) => route
                    .send(subject, headers, payload)
                    .await
                    .map_err(publish_refusal),
                Err(err) => Err(err),
            });
        }
        join_all(
            sent.into_iter()
                .map(|sent| async move { sent?.confirmed().await.map_err(publish_refusal) }),
        )
        .await
    }

    /// Publish `messages` as one atomic batch: all to one stream, stored whole or not at
    /// all. A message to another stream than the first's is refused naming its subject.
    pub(crate) async fn publish_atomic(&self, messages: Vec<Outgoing>) -> Result<BatchAck, Error> {
        let version = self.server_version()?;
        if !crate::nats::seek::at_least(&version, ATOMIC_SINCE) {
            return Err(Error::NotImplemented(format!(
                "an atomic batch needs nats-server {}.{} or later; this server is {version}",
                ATOMIC_SINCE.0, ATOMIC_SINCE.1
            )));
        }
        let mut first: Option<Route> = None;
        for (index, (subject, _, _)) in messages.iter().enumerate() {
            let field = format!("messages[{index}].subject");
            let route = self.publish_route(subject).await.map_err(|err| match err {
                Error::Invalid { detail, .. } => Error::Invalid {
                    field: Some(field.clone()),
                    detail: format!("messages[{index}]: {detail}"),
                },
                other => other,
            })?;
            match &first {
                Some(first) if !first.same_stream(&route) => {
                    return Err(Error::invalid(
                        &field,
                        format!(
                            "{field}: an atomic batch goes to one stream; messages[0] goes to {}, this one to {}",
                            first.stream, route.stream
                        ),
                    ));
                }
                Some(_) => {}
                None => first = Some(route),
            }
        }
        let route = first.ok_or_else(|| Error::invalid("messages", "messages: none"))?;
        route
            .publish_atomic(messages)
            .await
            .map_err(publish_refusal)
    }
}
