//! Delayed, scheduled and recurring delivery: a schedule is made on the stream that captures
//! its target subject, once that stream is found set up for it (it allows schedules, it
//! captures the gateway's schedule subjects, and no consumer of it would lease them); read,
//! listed and cancelled by id.
//!
//! May import: as the rest of `gateway`.

use std::collections::{HashMap, HashSet};

use time::OffsetDateTime;

use futures::future::join_all;

use super::Gateway;
use super::consumer::publish_refusal;
use crate::domain::schedule::{
    CLOCK_SKEW, CancelWindow, FIRES_LATE, SCHEDULE_HEADER, SCHEDULED_AT_HEADER, ScheduleId,
    TARGET_HEADER, TIME_ZONE_HEADER, When, namespace, rfc3339, subject_of,
};
use crate::error::Error;
use crate::nats::publish::Route;
use crate::nats::schedules::{self, Deletion, Schedule};

/// The first nats-server with message schedules (`@at` only).
const SCHEDULES_SINCE: (u64, u64) = (2, 12);
/// The first with recurring ones (`@every`, cron, zones).
const RECURRING_SINCE: (u64, u64) = (2, 14);

/// A schedule made.
#[derive(Debug, Clone)]
pub(crate) struct Scheduled {
    pub(crate) id: ScheduleId,
    /// The stream that holds it.
    pub(crate) stream: String,
    /// When it fires next.
    pub(crate) next: Option<OffsetDateTime>,
}

/// What one request already looked up (a batch of delayed messages looks up each target
/// subject's stream, and checks each stream's setup, once).
#[derive(Default)]
pub(crate) struct ScheduleChecks {
    set_up: HashSet<String>,
    routes: HashMap<String, Route>,
}

/// A schedule ready to publish: its own subject, its headers (what to deliver, when and
/// where), and what it will be once stored.
pub(crate) struct PreparedSchedule {
    subject: String,
    headers: async_nats::HeaderMap,
    /// The stream of its target, found set up for schedules: it goes there (whatever
    /// subjects the gateway last saw that stream capture).
    route: Route,
    pub(crate) scheduled: Scheduled,
}

impl Gateway {
    /// Deliver a message to `target` at `at` (at once when that is past).
    pub(crate) async fn schedule_once(
        &self,
        target: String,
        headers: async_nats::HeaderMap,
        payload: bytes::Bytes,
        at: OffsetDateTime,
        field: &str,
    ) -> Result<Scheduled, Error> {
        let prepared = self
            .prepare_once(&mut ScheduleChecks::default(), &target, headers, at, field)
            .await?;
        self.store_schedules(vec![(prepared, payload)], false)
            .await
            .pop()
            .unwrap_or_else(|| Err(Error::Unavailable("the schedule was not sent".into())))
    }

    /// A one-shot schedule of a message to `target` at `at`, ready to publish. `field`
    /// names what set the time (`delay` or `deliver_at`), for a refusal.
    pub(crate) async fn prepare_once(
        &self,
        checks: &mut ScheduleChecks,
        target: &str,
        mut headers: async_nats::HeaderMap,
        at: OffsetDateTime,
        field: &str,
    ) -> Result<PreparedSchedule, Error> {
        let max_ahead = self.config().max_schedule_ahead;
        let now = OffsetDateTime::now_utc();
        if time::Duration::try_from(max_ahead).is_ok_and(|max_ahead| at - now > max_ahead) {
            return Err(Error::invalid(
                field,
                format!(
                    "{field}: {} is more than --max-schedule-ahead ({}) away",
                    rfc3339(at),
                    humantime::format_duration(max_ahead)
                ),
            ));
        }
        headers.insert(SCHEDULED_AT_HEADER, rfc3339(at).as_str());
        self.prepare_schedule(checks, target, headers, When::At(at))
            .await
    }

    /// Make a recurring schedule delivering `payload` and `headers` to `target`.
    pub(crate) async fn schedule(
        &self,
        target: String,
        headers: async_nats::HeaderMap,
        payload: bytes::Bytes,
        when: When,
    ) -> Result<Scheduled, Error> {
        let recurring = when.is_recurring();
        let prepared = self
            .prepare_schedule(&mut ScheduleChecks::default(), &target, headers, when)
            .await?;
        self.store_schedules(vec![(prepared, payload)], recurring)
            .await
            .pop()
            .unwrap_or_else(|| Err(Error::Unavailable("the schedule was not sent".into())))
    }

    /// Publish prepared schedules: all sent, then every acknowledgement awaited. The
    /// server's refusal of a pattern or a zone names the field (`cron`, `time_zone`).
    pub(crate) async fn store_schedules(
        &self,
        schedules: Vec<(PreparedSchedule, bytes::Bytes)>,
        recurring: bool,
    ) -> Vec<Result<Scheduled, Error>> {
        let mut sent = Vec::with_capacity(schedules.len());
        for (prepared, payload) in schedules {
            let sending = prepared
                .route
                .send(prepared.subject, prepared.headers, payload)
                .await;
            sent.push((sending, prepared.scheduled));
        }
        join_all(sent.into_iter().map(|(sending, scheduled)| async move {
            sending
                .map_err(publish_refusal)?
                .confirmed()
                .await
                .map_err(publish_refusal)
                .map_err(|err| match err {
                    Error::Invalid { detail, .. } if detail.contains("time zone") => {
                        Error::invalid("time_zone", detail)
                    }
                    Error::Invalid { detail, .. } if recurring => Error::invalid("cron", detail),
                    other => other,
                })?;
            Ok(scheduled)
        }))
        .await
    }

    /// A schedule of a message to `target` as `when` says, ready to publish: the server can
    /// keep it (its version; the stream of `target` set up for schedules, checked once per
    /// `checks`).
    pub(crate) async fn prepare_schedule(
        &self,
        checks: &mut ScheduleChecks,
        target: &str,
        mut headers: async_nats::HeaderMap,
        when: When,
    ) -> Result<PreparedSchedule, Error> {
        let since = if when.is_recurring() {
            RECURRING_SINCE
        } else {
            SCHEDULES_SINCE
        };
        let version = self.server_version()?;
        if !crate::nats::seek::at_least(&version, since) {
            return Err(Error::NotImplemented(format!(
                "{} needs nats-server {}.{} or later; this server is {version}",
                if when.is_recurring() {
                    "a recurring schedule"
                } else {
                    "a delayed message"
                },
                since.0,
                since.1
            )));
        }
        let route = match checks.routes.get(target) {
            Some(route) => route.clone(),
            None => {
                let route = self.publish_route(target).await?;
                checks.routes.insert(target.to_owned(), route.clone());
                route
            }
        };
        if !checks.set_up.contains(&route.stream) {
            self.check_setup(&route).await?;
            checks.set_up.insert(route.stream.clone());
        }
        let prefix = &self.config().internal_prefix;
        // A msg id makes the schedule's subject its own: the stream refuses a retry as a
        // duplicate, and the answer names the schedule stored the first time.
        let id = match headers.get("Nats-Msg-Id") {
            Some(msg_id) => ScheduleId::of_msg_id(&route.stream, msg_id.as_str()),
            None => ScheduleId::new(&route.stream),
        };
        headers.insert(SCHEDULE_HEADER, when.header().as_str());
        headers.insert(TARGET_HEADER, target);
        if let When::Cron {
            zone: Some(zone), ..
        } = &when
        {
            headers.insert(TIME_ZONE_HEADER, zone.as_str());
        }
        let now = OffsetDateTime::now_utc();
        Ok(PreparedSchedule {
            subject: subject_of(prefix, &id),
            headers,
            scheduled: Scheduled {
                id,
                stream: route.stream.clone(),
                next: when.next_after(now, now),
            },
            route,
        })
    }

    /// Refuse to schedule on a stream not set up for it, naming what to change.
    async fn check_setup(&self, route: &Route) -> Result<(), Error> {
        let prefix = &self.config().internal_prefix;
        let setup = schedules::stream_setup(route, prefix)
            .await
            .map_err(|err| Error::Unavailable(format!("{err:#}")))?;
        let stream = &route.stream;
        if !setup.allows_schedules {
            return Err(Error::StreamDisallows {
                setting: "allow_msg_schedules",
                detail: format!(
                    "stream {stream} does not allow message schedules; set `allow_msg_schedules: true` in its configuration (nats-server 2.12 or later)"
                ),
            });
        }
        let namespace = namespace(prefix, stream);
        if !setup.captures_namespace {
            return Err(Error::StreamDisallows {
                setting: "subjects",
                detail: format!(
                    "stream {stream} does not capture {namespace}, where the gateway keeps its schedules so that no consumer leases them: add it to the stream's subjects"
                ),
            });
        }
        if let Some(consumer) = setup.leasing_consumer {
            return Err(Error::StreamDisallows {
                setting: "filter_subject",
                detail: format!(
                    "consumer {consumer} of stream {stream} would lease its schedules ({namespace}): give it a filter that leaves them out (e.g. only the stream's other subjects)"
                ),
            });
        }
        Ok(())
    }

    /// Schedule `id`, pending.
    pub(crate) async fn scheduled(&self, id: &ScheduleId) -> Result<Schedule, Error> {
        let js = self.jetstream()?;
        schedules::find(&js, &self.config().internal_prefix, id)
            .await
            .map_err(|err| Error::Unavailable(format!("{err:#}")))?
            .map(|(schedule, _)| schedule)
            .ok_or_else(|| no_schedule(id))
    }

    /// The pending schedules of `stream` (every served stream when `None`), to `subject`
    /// only when given.
    pub(crate) async fn list_schedules(
        &self,
        stream: Option<&str>,
        subject: Option<&str>,
    ) -> Result<Vec<Schedule>, Error> {
        let js = self.jetstream()?;
        let streams = match stream {
            Some(stream) => vec![stream.to_owned()],
            None => self.served_streams(),
        };
        let prefix = &self.config().internal_prefix;
        let mut listed = Vec::new();
        for stream in streams {
            let schedules = schedules::list(&js, prefix, &stream)
                .await
                .map_err(|err| Error::Unavailable(format!("{err:#}")))?;
            listed.extend(
                schedules
                    .into_iter()
                    .filter(|schedule| subject.is_none_or(|subject| schedule.target == subject)),
            );
        }
        Ok(listed)
    }

    /// Cancel schedule `id`: once answered, it never fires. The delete is sent only when
    /// it can be confirmed before the next fire time (a recurring schedule firing now is
    /// waited for, under a second); a one-shot due now is refused as firing.
    pub(crate) async fn cancel_schedule(&self, id: &ScheduleId) -> Result<(), Error> {
        let js = self.jetstream()?;
        let unavailable = |err: anyhow::Error| Error::Unavailable(format!("{err:#}"));
        let prefix = &self.config().internal_prefix;
        // A recurring schedule is decided again once, after the fire it waited for.
        let mut waited = false;
        loop {
            let Some((schedule, sequence)) = schedules::find(&js, prefix, id)
                .await
                .map_err(unavailable)?
            else {
                return Err(no_schedule(id));
            };
            let now = OffsetDateTime::now_utc();
            match schedule.when.cancel_window(now, schedule.made) {
                CancelWindow::Now { deadline } => {
                    let within = std::time::Duration::try_from(deadline - now).unwrap_or_default();
                    return match schedules::delete(&js, &id.stream, sequence, within)
                        .await
                        .map_err(unavailable)?
                    {
                        Deletion::Deleted => Ok(()),
                        Deletion::Gone => Err(no_schedule(id)),
                        Deletion::NotConfirmed => Err(Error::Unavailable(format!(
                            "the cancel of schedule {id} was not confirmed before its next fire time ({}): it may or may not stop it; ask again (404 once it is gone)",
                            rfc3339(deadline + CLOCK_SKEW)
                        ))),
                    };
                }
                CancelWindow::After(at) if !waited => {
                    tokio::time::sleep(std::time::Duration::try_from(at - now).unwrap_or_default())
                        .await;
                    waited = true;
                }
                CancelWindow::After(at) => return Err(firing(id, at - FIRES_LATE, now)),
                CancelWindow::Firing { due } => return Err(firing(id, due, now)),
            }
        }
    }

    /// The streams of the consumers served now, each once.
    fn served_streams(&self) -> Vec<String> {
        let mut streams: Vec<String> = self
            .0
            .registry
            .all()
            .into_iter()
            .filter(|(_, served)| !served.is_retired())
            .map(|(name, _)| name.stream)
            .collect();
        streams.sort();
        streams.dedup();
        streams
    }

    /// The version of the NATS server the gateway is connected to.
    pub(crate) fn server_version(&self) -> Result<String, Error> {
        self.0
            .process
            .connection
            .get()
            .map(|client| client.server_info().version)
            .ok_or_else(|| Error::Unavailable("not connected to NATS yet".into()))
    }
}

/// A cancel refused as too close to schedule `id`'s fire time `due`.
fn firing(id: &ScheduleId, due: OffsetDateTime, now: OffsetDateTime) -> Error {
    let wait = std::time::Duration::try_from(due - now).unwrap_or_default() + FIRES_LATE;
    Error::ScheduleFiring {
        detail: format!(
            "schedule {id} is due at {}: too close to its time for a cancel to be sure to stop it; retry after Retry-After seconds (once it fired, a one-shot answers 404)",
            rfc3339(due)
        ),
        retry_after: wait,
    }
}

fn no_schedule(id: &ScheduleId) -> Error {
    Error::NotFound(format!(
        "no pending schedule {id}: it was cancelled, or it fired (a one-shot schedule is gone once it fired)"
    ))
}
