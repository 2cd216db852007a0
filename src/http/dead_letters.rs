//! `GET /dead-letters` and `GET /dead-letters/{id}`: the dead letters, read without consuming
//! or changing anything, newest or oldest first, filtered by where they came from, why, and
//! when; a page at a time with a cursor.
//!
//! May import: as the rest of `http`.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Json;
use axum::extract::{FromRequestParts, Path, State};
use axum::http::Uri;
use axum::http::request::Parts;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use serde::Serialize;
use utoipa::{IntoParams, ToSchema};

use super::dto::{Encoding, rfc3339};
use super::responses::{DeadLetterRefusals, Guarded, NatsRefusals, QueryRefusals};
use crate::error::Error;
use crate::gateway::{Cursor, DeadLetterId, DeadLetterListing, Gateway};
use crate::nats::dead_letter_reader::{DeadLetter, Filter, FilterWords, Order};

/// Dead letters on one page unless the query says otherwise, and the most it may say.
const DEFAULT_LIMIT: usize = 100;
const MAX_LIMIT: usize = 1000;

/// The listing's query parameters as the spec describes them; [`ListQuery::parse`] reads them.
#[derive(IntoParams)]
#[into_params(parameter_in = Query)]
#[expect(
    dead_code,
    reason = "describes the query for the spec; the query is parsed by hand"
)]
pub(super) struct ListParams {
    /// `newest` (the default) or `oldest` first.
    #[param(pattern = "^(newest|oldest)$")]
    order: Option<String>,
    /// Only those of this source stream.
    stream: Option<String>,
    /// Only those of this consumer.
    consumer: Option<String>,
    /// Only those dead-lettered for this reason.
    #[param(pattern = "^(max_deliveries|terminated)$")]
    reason: Option<String>,
    /// Only those terminated with this reason; a trailing `*` matches every reason that
    /// begins with what is before it (`malformed*`).
    term_reason: Option<String>,
    /// Only those dead-lettered at or after this time (RFC 3339).
    since: Option<String>,
    /// Only those dead-lettered before this time (RFC 3339).
    until: Option<String>,
    /// Most dead letters on the page (1 to 1000, default 100).
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<u32>,
    /// How `data` is encoded, as in a fetch (default base64).
    encoding: Option<Encoding>,
    /// The `next` of the page before (with the same filters and order). `next=` is taken too.
    cursor: Option<String>,
}

/// What a listing asks for, from its query string.
struct ListQuery {
    listing: DeadLetterListing,
    encoding: Encoding,
}

impl ListQuery {
    fn parse(query: Option<&str>) -> Result<Self, Error> {
        let mut words = FilterWords::default();
        let mut order = Order::default();
        let mut limit = DEFAULT_LIMIT;
        let mut encoding = Encoding::default();
        let mut cursor = None;
        for (name, value) in pairs(query) {
            let value = value.as_str();
            match name.as_str() {
                "order" => {
                    order = match value {
                        "newest" | "newest_first" => Order::NewestFirst,
                        "oldest" | "oldest_first" => Order::OldestFirst,
                        other => {
                            return Err(Error::invalid(
                                "order",
                                format!("order: must be newest or oldest, got {other:?}"),
                            ));
                        }
                    }
                }
                "stream" => words.stream = Some(value.to_owned()),
                "consumer" => words.consumer = Some(value.to_owned()),
                "reason" => words.reason = Some(value.to_owned()),
                "term_reason" => words.term_reason = Some(value.to_owned()),
                "since" => words.since = Some(value.to_owned()),
                "until" => words.until = Some(value.to_owned()),
                "limit" => {
                    limit = value
                        .parse::<usize>()
                        .ok()
                        .filter(|n| (1..=MAX_LIMIT).contains(n))
                        .ok_or_else(|| {
                            Error::invalid(
                                "limit",
                                format!(
                                    "limit: must be a whole number from 1 to {MAX_LIMIT}, got {value:?}"
                                ),
                            )
                        })?;
                }
                "encoding" => encoding = encoding_of(value)?,
                "cursor" | "next" => {
                    cursor = Some(Cursor::decode(value).ok_or_else(|| {
                        Error::invalid(
                            "cursor",
                            "cursor: not one a listing gave; pass its `next` as it is",
                        )
                    })?);
                }
                other => {
                    return Err(unknown(
                        other,
                        "order, stream, consumer, reason, term_reason, since, until, limit, encoding, cursor",
                    ));
                }
            }
        }
        let filter = filter_of(&words)?;
        Ok(Self {
            listing: DeadLetterListing {
                order,
                filter,
                limit,
                cursor,
            },
            encoding,
        })
    }
}

/// A query string's `name=value` pairs, percent-decoded (`+` stays a plus: an RFC 3339
/// offset is written with one).
pub(super) fn pairs(query: Option<&str>) -> impl Iterator<Item = (String, String)> + '_ {
    query
        .unwrap_or_default()
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            let decode = |part: &str| {
                percent_encoding::percent_decode_str(part)
                    .decode_utf8_lossy()
                    .into_owned()
            };
            (decode(name), decode(value))
        })
}

/// The filter `words` say, or a 422 naming the word that means nothing.
fn filter_of(words: &FilterWords) -> Result<Filter, Error> {
    Filter::from_words(words).map_err(|bad| Error::invalid(bad.field, bad.detail))
}

fn encoding_of(value: &str) -> Result<Encoding, Error> {
    match value {
        "base64" => Ok(Encoding::Base64),
        "utf8" => Ok(Encoding::Utf8),
        other => Err(Error::invalid(
            "encoding",
            format!("encoding: must be base64 or utf8, got {other:?}"),
        )),
    }
}

fn unknown(name: &str, known: &str) -> Error {
    let shown: String = name.chars().take(64).collect();
    Error::invalid(
        shown.as_str(),
        format!("unknown query parameter {shown:?} (known: {known})"),
    )
}

/// One dead letter: where it came from, why, and the message as it was published.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({
    "id": "DLQ:17",
    "dead_letter_sequence": 17,
    "reason": "terminated",
    "term_reason": "malformed: no total",
    "stream": "ORDERS",
    "consumer": "billing",
    "stream_sequence": 4711,
    "subject": "orders.created",
    "deliveries": 1,
    "published_at": "2026-12-02T02:59:58.123Z",
    "dead_lettered_at": "2026-12-02T03:00:01.456Z",
    "data": "{\"order\":4711}",
    "encoding": "utf8",
    "headers": {"Content-Type": ["application/json"]}
}))]
pub(crate) struct DeadLetterDto {
    /// Its id: for `GET /dead-letters/{id}` and a redrive's `ids`.
    id: String,
    /// Its sequence in the dead-letter stream.
    dead_letter_sequence: u64,
    /// `max_deliveries` (the consumer's `max_deliver` ran out) or `terminated`.
    reason: String,
    /// The reason its term gave; null when none was given.
    term_reason: Option<String>,
    /// The stream it was consumed from.
    stream: String,
    consumer: String,
    /// Its sequence in that stream.
    stream_sequence: u64,
    /// The subject it was published to.
    subject: String,
    /// How many times the consumer delivered it.
    deliveries: u64,
    /// When it was published (RFC 3339).
    published_at: Option<String>,
    /// When it was stored as a dead letter (RFC 3339).
    dead_lettered_at: String,
    /// The payload, encoded as `encoding` says.
    data: String,
    encoding: Encoding,
    /// The message's own headers (the dead-letter metadata is in the fields above).
    headers: BTreeMap<String, Vec<String>>,
}

impl DeadLetterDto {
    pub(super) fn new(letter: DeadLetter, wanted: Encoding) -> Self {
        let (data, encoding) = match (wanted, std::str::from_utf8(&letter.payload)) {
            (Encoding::Utf8, Ok(text)) => (text.to_owned(), Encoding::Utf8),
            _ => (STANDARD.encode(&letter.payload), Encoding::Base64),
        };
        let mut headers = BTreeMap::<String, Vec<String>>::new();
        for (name, values) in letter.headers.iter() {
            headers
                .entry(name.to_string())
                .or_default()
                .extend(values.iter().map(ToString::to_string));
        }
        Self {
            id: DeadLetterId::of(&letter).to_string(),
            dead_letter_sequence: letter.sequence,
            reason: letter.reason,
            term_reason: letter.term_reason,
            stream: letter.stream,
            consumer: letter.consumer,
            stream_sequence: letter.stream_sequence,
            subject: letter.subject,
            deliveries: letter.deliveries,
            published_at: letter.published_at,
            dead_lettered_at: rfc3339(letter.dead_lettered_at),
            data,
            encoding,
            headers,
        }
    }
}

/// A page of dead letters.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct DeadLettersDto {
    dead_letters: Vec<DeadLetterDto>,
    /// Pass as `cursor` for the next page; null when nothing further matches. A page may be
    /// shorter than `limit`, even empty, with a `next`: one request looks at no more than
    /// 50 000 dead letters.
    next: Option<String>,
}

/// List dead letters, newest (default) or oldest first, filtered, a page at a time.
///
/// Reads the streams that capture the dead-letter subjects (`--dead-letter-subject`, each
/// consumer's `dead_letter_subject`), found by subject; reading never consumes or changes
/// anything. With several such streams, one's dead letters follow the other's, by stream name.
#[utoipa::path(
    get,
    path = "/dead-letters",
    operation_id = "listDeadLetters",
    tag = "operations",
    params(ListParams),
    responses(
        (status = 200, description = "A page of dead letters", body = DeadLettersDto),
        Guarded, QueryRefusals, NatsRefusals,
    )
)]
pub(crate) async fn list(
    State(gateway): State<Arc<Gateway>>,
    uri: Uri,
) -> Result<Json<DeadLettersDto>, Error> {
    let query = ListQuery::parse(uri.query())?;
    let page = gateway.dead_letters(query.listing).await?;
    Ok(Json(DeadLettersDto {
        dead_letters: page
            .letters
            .into_iter()
            .map(|letter| DeadLetterDto::new(letter, query.encoding))
            .collect(),
        next: page.next.map(|cursor| cursor.encode()),
    }))
}

/// The `{id}` path segment of a dead letter.
#[derive(IntoParams)]
#[into_params(names("id"), parameter_in = Path)]
pub(crate) struct DeadLetterPath(
    /// A dead letter's `id`, as a listing gives it.
    #[param(example = "DLQ:17")]
    String,
);

impl<S: Send + Sync> FromRequestParts<S> for DeadLetterPath {
    type Rejection = Error;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        Path::<String>::from_request_parts(parts, state)
            .await
            .map(|Path(id)| Self(id))
            .map_err(|_| Error::NotFound("the path names no dead letter".into()))
    }
}

/// The encoding parameter of `GET /dead-letters/{id}`.
#[derive(IntoParams)]
#[into_params(parameter_in = Query)]
#[expect(
    dead_code,
    reason = "describes the query for the spec; the query is parsed by hand"
)]
pub(super) struct OneParams {
    /// How `data` is encoded, as in a fetch (default base64).
    encoding: Option<Encoding>,
}

/// One dead letter by its id.
#[utoipa::path(
    get,
    path = "/dead-letters/{id}",
    operation_id = "getDeadLetter",
    tag = "operations",
    params(DeadLetterPath, OneParams),
    responses(
        (status = 200, description = "The dead letter", body = DeadLetterDto),
        Guarded, QueryRefusals, DeadLetterRefusals,
    )
)]
pub(crate) async fn one(
    State(gateway): State<Arc<Gateway>>,
    DeadLetterPath(id): DeadLetterPath,
    uri: Uri,
) -> Result<Json<DeadLetterDto>, Error> {
    let mut encoding = Encoding::default();
    for (name, value) in pairs(uri.query()) {
        match name.as_str() {
            "encoding" => encoding = encoding_of(&value)?,
            other => return Err(unknown(other, "encoding")),
        }
    }
    let id = DeadLetterId::parse(&id)
        .ok_or_else(|| Error::NotFound(format!("{id:?} is not a dead letter's id")))?;
    let letter = gateway.dead_letter(&id).await?;
    Ok(Json(DeadLetterDto::new(letter, encoding)))
}
