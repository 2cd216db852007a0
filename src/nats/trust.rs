//! Which messages under the internal prefix a replica believes: every one it sends carries a
//! seal ([`crate::domain::seal`]) in a header, and every one it reads is opened before use.
//! One that fails is dropped, counted in `ruststream_internal_messages_rejected_total{kind}`
//! and logged at most once a minute per kind (a flood of forgeries must not flood the log).
//! Unsealed messages, as releases before seals wrote them, are believed only with
//! `--accept-unsigned-replicas`, for the length of a rolling upgrade.
//!
//! May import: `domain`. Nothing of the gateway above the boundary.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use prometheus::IntCounterVec;
use tracing::error;

use crate::domain::lease_id::InstanceId;
use crate::domain::seal::{self, Kind, Rejection, Sealer};

/// How often a rejection of one kind is logged at most.
const LOG_EVERY: Duration = Duration::from_secs(60);

/// This replica's seal and its rules for believing others'.
pub(crate) struct Trust {
    sealer: Sealer,
    accept_unsealed: bool,
    rejected: IntCounterVec,
    logged: Mutex<HashMap<Kind, Instant>>,
}

impl Trust {
    pub(crate) fn new(sealer: Sealer, accept_unsealed: bool, rejected: IntCounterVec) -> Self {
        Self {
            sealer,
            accept_unsealed,
            rejected,
            logged: Mutex::default(),
        }
    }

    /// Seal a message of `kind` to be sent on `subject` now.
    pub(crate) fn seal(&self, kind: Kind, subject: &str, parts: &[&[u8]], headers: &mut HeaderMap) {
        let value = self.sealer.seal(kind, subject, parts, now_unix_ms());
        headers.insert(seal::HEADER, value.as_str());
    }

    /// Whether to believe a message of `kind` read from `subject`: sealed with the shared key
    /// over exactly this content at most `max_age` ago, by `claimed` when the message names
    /// its sender. A message not believed is counted and (at most once a minute) logged.
    pub(crate) fn believe(
        &self,
        kind: Kind,
        subject: &str,
        parts: &[&[u8]],
        headers: Option<&HeaderMap>,
        max_age: Duration,
        claimed: Option<InstanceId>,
    ) -> bool {
        let verdict = match headers.and_then(|headers| headers.get(seal::HEADER)) {
            None if self.accept_unsealed => Ok(()),
            None => Err(Rejection::Unsealed),
            Some(value) => self
                .sealer
                .open(
                    kind,
                    subject,
                    parts,
                    value.as_str(),
                    now_unix_ms(),
                    i64::try_from(max_age.as_millis()).unwrap_or(i64::MAX),
                )
                .and_then(|sender| match claimed {
                    Some(claimed) if claimed != sender => Err(Rejection::WrongSender),
                    _ => Ok(()),
                }),
        };
        let Err(why) = verdict else {
            return true;
        };
        self.rejected.with_label_values(&[kind.as_str()]).inc();
        let now = Instant::now();
        let due = self.logged.lock().is_ok_and(|mut logged| {
            let due = logged
                .get(&kind)
                .is_none_or(|last| now.duration_since(*last) >= LOG_EVERY);
            if due {
                logged.insert(kind, now);
            }
            due
        });
        if due {
            error!(
                kind = kind.as_str(),
                %subject,
                claimed_sender = ?claimed.map(|sender| sender.to_string()),
                "dropped a message under the internal prefix that {}; counted in ruststream_internal_messages_rejected_total, logged at most once a minute",
                why.describe()
            );
        }
        false
    }
}

fn now_unix_ms() -> i64 {
    i64::try_from(time::OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000)
        .unwrap_or(i64::MAX)
}
