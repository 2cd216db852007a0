//! The settings of a consumer that the server takes while it is in use (ack_wait and
//! max_ack_pending): a consumers file that changes only those is applied at once, without
//! binding the consumer anew, so fetches go on and the leases out keep theirs; any other
//! change (filter, deliver policy, max_deliver, dead letters, ordering) needs a new binding.
//!
//! May import: as the rest of `gateway`.

use std::borrow::Cow;
use std::sync::Mutex;
use std::time::Duration;

use tracing::info;

use super::Consumer;
use crate::config::{Config, ConsumerSpec};
use crate::error::Error;
use crate::nats;

/// What a consumers file's entry asks of a consumer served now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SettingsChange {
    /// It runs as the entry says.
    None,
    /// Only ack_wait or max_ack_pending differ: applied to the live consumer.
    Live,
    /// Something only a new binding can apply.
    Rebind,
}

/// The ack_wait and max_ack_pending last applied live, which override the ones the consumer
/// was started with: a later full bind (the consumer deleted and made again) makes the
/// consumer with these, not with the start's.
#[derive(Default)]
pub(super) struct LiveSettings(Mutex<Option<(Duration, u32)>>);

impl LiveSettings {
    fn get(&self, config: &Config) -> (Duration, u32) {
        self.0
            .lock()
            .ok()
            .and_then(|applied| *applied)
            .unwrap_or((config.ack_wait, config.max_ack_pending))
    }

    fn set(&self, ack_wait: Duration, max_ack_pending: u32) {
        if let Ok(mut applied) = self.0.lock() {
            *applied = Some((ack_wait, max_ack_pending));
        }
    }

    /// `config` with the settings applied live since it was read.
    pub(super) fn applied_to<'a>(&self, config: &'a Config) -> Cow<'a, Config> {
        let (ack_wait, max_ack_pending) = self.get(config);
        if (ack_wait, max_ack_pending) == (config.ack_wait, config.max_ack_pending) {
            return Cow::Borrowed(config);
        }
        let mut changed = config.clone();
        changed.ack_wait = ack_wait;
        changed.max_ack_pending = max_ack_pending;
        Cow::Owned(changed)
    }
}

impl Consumer {
    /// How `spec` differs from what this consumer runs with now.
    pub(crate) fn change_to(&self, spec: &ConsumerSpec) -> SettingsChange {
        let have = &self.config;
        let same_binding = have.filter_subject == spec.filter_subject
            && have.deliver_policy == spec.deliver_policy
            && have.max_deliver == spec.max_deliver
            && have.dead_letter_subject == spec.dead_letter_subject
            && have.ordering_key == spec.ordering_key;
        if !same_binding {
            return SettingsChange::Rebind;
        }
        if self.live_settings.get(have) == (spec.ack_wait, spec.max_ack_pending) {
            SettingsChange::None
        } else {
            SettingsChange::Live
        }
    }

    /// Give the consumer `spec`'s ack_wait and max_ack_pending at the server and follow
    /// them here: new leases last the new ack_wait; leases out keep their deadline, or end
    /// sooner where a shorter ack_wait makes the server redeliver sooner.
    pub(crate) async fn apply_live(&self, spec: &ConsumerSpec) -> Result<(), Error> {
        let bound = self.connected()?;
        nats::publish::update_settings(
            &bound,
            &self.name.stream,
            spec.ack_wait,
            spec.max_ack_pending,
        )
        .await
        .map_err(|err| Error::Unavailable(format!("{err:#}")))?;
        self.live_settings.set(spec.ack_wait, spec.max_ack_pending);
        info!(
            consumer = %self.name,
            ack_wait = %humantime::format_duration(spec.ack_wait),
            max_ack_pending = spec.max_ack_pending,
            "the consumers file changed this consumer's ack_wait/max_ack_pending; applied to the live consumer"
        );
        self.follow_settings(
            spec.ack_wait,
            usize::try_from(spec.max_ack_pending).unwrap_or(usize::MAX),
        );
        Ok(())
    }
}
