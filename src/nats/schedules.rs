//! Message schedules at the server: a schedule is a message of the stream, on a subject of
//! the gateway's namespace (`<prefix>.schedule.<stream>.<token>`), whose `Nats-Schedule`
//! says when nats-server delivers its data and headers to `Nats-Schedule-Target`. Made by
//! publishing it (as any message); here: whether a stream is set up for them, read back by
//! subject, cancelled by deleting it (not atomic with its firing: the server takes up a due
//! schedule before it fires it, so the gateway deletes only well before a fire time —
//! `domain::schedule::CancelWindow`).
//!
//! May import: as the rest of `nats`.

use anyhow::Context as _;
use async_nats::jetstream::{self, ErrorCode};
use futures::TryStreamExt as _;
use time::OffsetDateTime;

use super::API_TIMEOUT;
use super::publish::Route;
use crate::domain::schedule::{
    SCHEDULE_HEADER, ScheduleId, TARGET_HEADER, TIME_ZONE_HEADER, When, namespace, subject_of,
};
use crate::domain::subject;

/// Most schedules one listing reads.
pub(crate) const LIST_LIMIT: usize = 1000;

/// A schedule as the server holds it.
#[derive(Debug, Clone)]
pub(crate) struct Schedule {
    pub(crate) id: ScheduleId,
    /// Where it delivers.
    pub(crate) target: String,
    pub(crate) when: When,
    /// When it was stored (for an `@every`, what its intervals count from).
    pub(crate) made: OffsetDateTime,
}

/// What scheduling on a stream needs of it, read from the server.
#[derive(Debug, Clone)]
pub(crate) struct StreamSetup {
    /// `allow_msg_schedules`.
    pub(crate) allows_schedules: bool,
    /// Whether it captures the gateway's schedule namespace for it.
    pub(crate) captures_namespace: bool,
    /// A consumer of the stream whose filter takes the namespace: it would lease schedules.
    pub(crate) leasing_consumer: Option<String>,
}

/// Read whether `route`'s stream is set up for the gateway's schedules.
pub(crate) async fn stream_setup(route: &Route, prefix: &str) -> anyhow::Result<StreamSetup> {
    let js = route.jetstream();
    let stream = tokio::time::timeout(API_TIMEOUT, js.get_stream(&route.stream))
        .await
        .context("timed out looking up the stream")?
        .context("looking up the stream")?;
    let config = stream.cached_info().config.clone();
    let probe = subject_of(prefix, &ScheduleId::new(&route.stream));
    let captures_namespace = config
        .subjects
        .iter()
        .any(|filter| subject::matches(filter, &probe));
    let consumers: Vec<jetstream::consumer::Info> =
        tokio::time::timeout(API_TIMEOUT, stream.consumers().try_collect())
            .await
            .context("timed out listing the stream's consumers")?
            .context("listing the stream's consumers")?;
    let leasing_consumer = consumers
        .into_iter()
        .find(|info| {
            let filters: Vec<&str> = if info.config.filter_subjects.is_empty() {
                [info.config.filter_subject.as_str()]
                    .into_iter()
                    .filter(|filter| !filter.is_empty())
                    .collect()
            } else {
                info.config
                    .filter_subjects
                    .iter()
                    .map(String::as_str)
                    .collect()
            };
            filters.is_empty()
                || filters
                    .iter()
                    .any(|filter| subject::matches(filter, &probe))
        })
        .map(|info| info.name);
    Ok(StreamSetup {
        allows_schedules: config.allow_message_schedules,
        captures_namespace,
        leasing_consumer,
    })
}

/// Schedule `id` as the server holds it; `None` when there is none (cancelled, or a one-shot
/// that fired).
pub(crate) async fn find(
    js: &jetstream::Context,
    prefix: &str,
    id: &ScheduleId,
) -> anyhow::Result<Option<(Schedule, u64)>> {
    use jetstream::stream::LastRawMessageErrorKind;
    let stream = js
        .get_stream_no_info(&id.stream)
        .await
        .context("looking up the stream")?;
    let read = tokio::time::timeout(
        API_TIMEOUT,
        stream.get_last_raw_message_by_subject(&subject_of(prefix, id)),
    )
    .await
    .context("timed out reading the schedule")?;
    let message = match read {
        Ok(message) => message,
        // No such message, or no such stream: no such schedule.
        Err(err)
            if matches!(err.kind(), LastRawMessageErrorKind::NoMessageFound)
                || matches!(err.kind(), LastRawMessageErrorKind::JetStream(api) if api.code() == 404) =>
        {
            return Ok(None);
        }
        Err(err) => return Err(err).context("reading the schedule"),
    };
    let header = |name: &str| {
        message
            .headers
            .get(name)
            .map(|value| value.as_str().to_owned())
    };
    let (Some(pattern), Some(target)) = (header(SCHEDULE_HEADER), header(TARGET_HEADER)) else {
        return Ok(None);
    };
    let Some(when) = When::from_header(&pattern, header(TIME_ZONE_HEADER).as_deref()) else {
        return Ok(None);
    };
    let made = OffsetDateTime::from_unix_timestamp_nanos(
        i128::from(message.time.unix_timestamp()) * 1_000_000_000
            + i128::from(message.time.nanosecond()),
    )
    .unwrap_or(OffsetDateTime::UNIX_EPOCH);
    Ok(Some((
        Schedule {
            id: id.clone(),
            target,
            when,
            made,
        },
        message.sequence,
    )))
}

/// The schedules of `stream` (at most [`LIST_LIMIT`]).
pub(crate) async fn list(
    js: &jetstream::Context,
    prefix: &str,
    stream: &str,
) -> anyhow::Result<Vec<Schedule>> {
    let handle = js
        .get_stream_no_info(stream)
        .await
        .context("looking up the stream")?;
    let listing = match handle.info_with_subjects(namespace(prefix, stream)).await {
        Ok(listing) => listing,
        // No such stream: no schedules on it.
        Err(err)
            if std::error::Error::source(&err)
                .and_then(|source| source.downcast_ref::<jetstream::Error>())
                .is_some_and(|api| api.error_code() == ErrorCode::STREAM_NOT_FOUND) =>
        {
            return Ok(Vec::new());
        }
        Err(err) => return Err(err).context("listing the stream's schedule subjects"),
    };
    let subjects: Vec<(String, usize)> = tokio::time::timeout(API_TIMEOUT, listing.try_collect())
        .await
        .context("timed out listing the stream's schedule subjects")?
        .context("listing the stream's schedule subjects")?;
    let mut schedules = Vec::new();
    for (subject, _) in subjects.into_iter().take(LIST_LIMIT) {
        let Some(id) = ScheduleId::of_subject(prefix, &subject) else {
            continue;
        };
        if let Some((schedule, _)) = find(js, prefix, &id).await? {
            schedules.push(schedule);
        }
    }
    schedules.sort_by_key(|schedule| schedule.made);
    Ok(schedules)
}

/// How deleting a schedule's message ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Deletion {
    /// Deleted, confirmed in time.
    Deleted,
    /// Not there any more: it fired (a one-shot), or was cancelled, since it was read.
    Gone,
    /// Not confirmed in time: it may or may not be deleted.
    NotConfirmed,
}

/// Delete schedule message `sequence` of `stream`, waiting at most `within` (and no longer
/// than any API call) for the server's confirmation.
pub(crate) async fn delete(
    js: &jetstream::Context,
    stream: &str,
    sequence: u64,
    within: std::time::Duration,
) -> anyhow::Result<Deletion> {
    use jetstream::stream::DeleteMessageErrorKind;
    let stream = js
        .get_stream_no_info(stream)
        .await
        .context("looking up the stream")?;
    let within = within.min(API_TIMEOUT);
    let Ok(deleted) = tokio::time::timeout(within, stream.delete_message(sequence)).await else {
        return Ok(Deletion::NotConfirmed);
    };
    match deleted {
        Ok(true) => Ok(Deletion::Deleted),
        Ok(false) => Ok(Deletion::Gone),
        // Fired (and so removed) since it was read: the server says the delete failed
        // because there is no such message (10057 wrapping "no message found").
        Err(err)
            if matches!(err.kind(), DeleteMessageErrorKind::JetStream(api)
                if api.error_code() == ErrorCode::NO_MESSAGE_FOUND
                    || api.error_code() == ErrorCode::SEQUENCE_NOT_FOUND
                    || (api.error_code() == ErrorCode::STREAM_MESSAGE_DELETE_FAILED
                        && api.to_string().contains("no message found"))) =>
        {
            Ok(Deletion::Gone)
        }
        Err(err) => Err(err).context("deleting the schedule"),
    }
}
