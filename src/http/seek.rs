//! `POST /streams/{stream}/consumers/{consumer}/seek`: rewind (or fast-forward) a consumer
//! to a stream sequence, a time, its stream's beginning or end, through the server's
//! consumer reset; a dry run says where that is and what it would re-deliver or skip.
//!
//! May import: as the rest of `http`.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use utoipa::ToSchema;

use super::body::JsonBody;
use super::consumers::ConsumerPath;
use super::responses::{BodyRefusals, Guarded, SeekRefusals};
use crate::error::Error;
use crate::gateway::{Gateway, SeekTarget, Target};

/// `POST …/seek` body: exactly one of `sequence`, `time` and `position`.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"time": "2026-12-02T03:00:00Z", "dry_run": true}))]
pub(crate) struct SeekBody {
    /// The stream sequence to deliver next: 1 up to the stream's last sequence + 1 (the
    /// end: only what is published from now on).
    #[schema(minimum = 1, maximum = 9_223_372_036_854_775_807_i64)]
    sequence: Option<u64>,
    /// Deliver next the first message stored at or after this time (RFC 3339).
    time: Option<String>,
    /// `beginning`: the stream's first message; `end`: only what is published from now on.
    #[schema(pattern = "^(beginning|end)$")]
    position: Option<String>,
    /// Only say where the consumer would move and what that would re-deliver or skip.
    #[serde(default)]
    dry_run: bool,
}

/// Where a consumer was moved (or, in a dry run, would be).
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"stream": "ORDERS", "consumer": "shipping", "sequence": 1204, "redelivers": 96, "skips": 0, "dry_run": false}))]
pub(crate) struct SeekDto {
    stream: String,
    consumer: String,
    /// The next stream sequence the consumer delivers.
    sequence: u64,
    /// Messages it had delivered that it delivers again (its filter applied).
    redelivers: u64,
    /// Messages it had yet to deliver that it never will.
    skips: u64,
    /// True when nothing was moved.
    dry_run: bool,
}

/// Move a consumer to a stream sequence, a time, or its stream's beginning or end, without
/// deleting it (the server's consumer reset, nats-server 2.14 or later: 501 on an older
/// one). A sequence past the stream's end (its last sequence + 1) is 422: it would skip
/// messages not even published yet. Every live lease of the consumer is void afterwards (its settles answer 410), at
/// every replica within a second, and the messages the move delivers again are leased again,
/// even those acked before. `dry_run` moves nothing.
#[utoipa::path(
    post,
    path = "/streams/{stream}/consumers/{consumer}/seek",
    operation_id = "seekConsumer",
    tag = "operations",
    params(ConsumerPath),
    request_body(content = SeekBody, content_type = "application/json"),
    responses(
        (status = 200, description = "Moved, or (dry run) where it would move", body = SeekDto),
        Guarded, BodyRefusals, SeekRefusals,
    )
)]
pub(crate) async fn seek(
    State(gateway): State<Arc<Gateway>>,
    path: ConsumerPath,
    JsonBody(body): JsonBody<SeekBody>,
) -> Result<Json<SeekDto>, Error> {
    let target = target(&body)?;
    let name = path.name();
    let consumer = gateway.consumer(Target::Named(&name)).await?;
    let moved = consumer.seek(target, body.dry_run).await?;
    Ok(Json(SeekDto {
        stream: name.stream,
        consumer: name.consumer,
        sequence: moved.sequence,
        redelivers: moved.redelivers,
        skips: moved.skips,
        dry_run: body.dry_run,
    }))
}

fn target(body: &SeekBody) -> Result<SeekTarget, Error> {
    let given = [
        body.sequence.is_some(),
        body.time.is_some(),
        body.position.is_some(),
    ];
    if given.iter().filter(|given| **given).count() != 1 {
        let field = if body.sequence.is_some() {
            "sequence"
        } else if body.time.is_some() {
            "time"
        } else {
            "position"
        };
        return Err(Error::invalid(
            field,
            "give exactly one of sequence, time and position",
        ));
    }
    if let Some(sequence) = body.sequence {
        if sequence == 0 {
            return Err(Error::invalid(
                "sequence",
                "sequence: stream sequences start at 1",
            ));
        }
        // The schema's bound (int64), whatever the stream: no stream gets that far.
        if i64::try_from(sequence).is_err() {
            return Err(Error::invalid(
                "sequence",
                format!("sequence: at most {} (2^63 - 1), got {sequence}", i64::MAX),
            ));
        }
        return Ok(SeekTarget::Sequence(sequence));
    }
    if let Some(time) = &body.time {
        let at = OffsetDateTime::parse(time, &Rfc3339)
            .map_err(|err| Error::invalid("time", format!("time: not an RFC 3339 time: {err}")))?;
        return Ok(SeekTarget::Time(at));
    }
    match body.position.as_deref() {
        Some("beginning") => Ok(SeekTarget::Beginning),
        Some("end") => Ok(SeekTarget::End),
        other => Err(Error::invalid(
            "position",
            format!(
                "position: must be \"beginning\" or \"end\", got {:?}",
                other.unwrap_or_default()
            ),
        )),
    }
}
