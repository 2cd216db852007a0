//! Which dead letters a listing or a redrive takes: a filter in the words a query or a
//! request body gives it, checked, and matched against a dead letter's metadata.
//!
//! May import: `domain`. Nothing of the gateway above the NATS boundary.

use time::OffsetDateTime;

use super::letter::DeadLetter;
use crate::nats::dead_letter::{REASON_MAX_DELIVERIES, REASON_TERMINATED};

/// Why a message was dead-lettered, as a filter names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reason {
    MaxDeliveries,
    Terminated,
}

impl Reason {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::MaxDeliveries => REASON_MAX_DELIVERIES,
            Self::Terminated => REASON_TERMINATED,
        }
    }
}

/// A term reason to match: all of it, or how it begins.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum TermReason {
    Exactly(String),
    StartingWith(String),
}

/// Which dead letters a listing or a redrive takes. Empty: all of them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Filter {
    pub(crate) stream: Option<String>,
    pub(crate) consumer: Option<String>,
    pub(crate) reason: Option<Reason>,
    pub(crate) term_reason: Option<TermReason>,
    /// Dead-lettered at or after.
    pub(crate) since: Option<OffsetDateTime>,
    /// Dead-lettered before.
    pub(crate) until: Option<OffsetDateTime>,
}

impl Filter {
    pub(crate) fn matches(&self, letter: &DeadLetter) -> bool {
        let term_reason = letter.term_reason.as_deref();
        self.stream.as_ref().is_none_or(|s| *s == letter.stream)
            && self.consumer.as_ref().is_none_or(|c| *c == letter.consumer)
            && self.reason.is_none_or(|r| r.as_str() == letter.reason)
            && match &self.term_reason {
                None => true,
                Some(TermReason::Exactly(want)) => term_reason == Some(want.as_str()),
                Some(TermReason::StartingWith(prefix)) => {
                    term_reason.is_some_and(|have| have.starts_with(prefix.as_str()))
                }
            }
            && self.in_time(letter.dead_lettered_at)
    }

    fn in_time(&self, at: OffsetDateTime) -> bool {
        self.since.is_none_or(|since| at >= since) && self.until.is_none_or(|until| at < until)
    }

    /// Whether some dead letter could be taken by both filters: `false` only when a word of
    /// one rules out everything the other takes (another stream, consumer or reason, term
    /// reasons that cannot both hold, time windows apart).
    pub(crate) fn may_share(&self, other: &Self) -> bool {
        fn apart<T: PartialEq>(one: Option<&T>, other: Option<&T>) -> bool {
            matches!((one, other), (Some(one), Some(other)) if one != other)
        }
        let term_reasons_apart = match (&self.term_reason, &other.term_reason) {
            (Some(TermReason::Exactly(one)), Some(TermReason::Exactly(other))) => one != other,
            (Some(TermReason::Exactly(exact)), Some(TermReason::StartingWith(prefix)))
            | (Some(TermReason::StartingWith(prefix)), Some(TermReason::Exactly(exact))) => {
                !exact.starts_with(prefix.as_str())
            }
            (Some(TermReason::StartingWith(one)), Some(TermReason::StartingWith(other))) => {
                !one.starts_with(other.as_str()) && !other.starts_with(one.as_str())
            }
            _ => false,
        };
        // [since, until) windows apart: one ends before the other begins.
        let ends_before = |one: &Self, other: &Self| matches!((one.until, other.since), (Some(until), Some(since)) if until <= since);
        !(apart(self.stream.as_ref(), other.stream.as_ref())
            || apart(self.consumer.as_ref(), other.consumer.as_ref())
            || apart(self.reason.as_ref(), other.reason.as_ref())
            || term_reasons_apart
            || ends_before(self, other)
            || ends_before(other, self))
    }
}

/// A filter in the words a query or a request body gives it (what a redrive task keeps).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct FilterWords {
    pub(crate) stream: Option<String>,
    pub(crate) consumer: Option<String>,
    /// `max_deliveries` or `terminated`.
    pub(crate) reason: Option<String>,
    /// Exactly, or a prefix before a trailing `*`.
    pub(crate) term_reason: Option<String>,
    /// RFC 3339.
    pub(crate) since: Option<String>,
    pub(crate) until: Option<String>,
}

/// A word of a filter that means nothing: the field, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BadWord {
    pub(crate) field: &'static str,
    pub(crate) detail: String,
}

impl Filter {
    /// The filter `words` say.
    pub(crate) fn from_words(words: &FilterWords) -> Result<Self, BadWord> {
        let reason = match words.reason.as_deref() {
            None => None,
            Some(REASON_MAX_DELIVERIES) => Some(Reason::MaxDeliveries),
            Some(REASON_TERMINATED) => Some(Reason::Terminated),
            Some(other) => {
                return Err(BadWord {
                    field: "reason",
                    detail: format!("reason: must be max_deliveries or terminated, got {other:?}"),
                });
            }
        };
        let term_reason = words
            .term_reason
            .as_ref()
            .map(|reason| match reason.strip_suffix('*') {
                Some(prefix) => TermReason::StartingWith(prefix.to_owned()),
                None => TermReason::Exactly(reason.clone()),
            });
        let time = |field: &'static str, value: &Option<String>| {
            value
                .as_deref()
                .map(|value| {
                    OffsetDateTime::parse(value, &time::format_description::well_known::Rfc3339)
                        .map_err(|err| BadWord {
                            field,
                            detail: format!("{field}: not an RFC 3339 time: {err}"),
                        })
                })
                .transpose()
        };
        let (since, until) = (time("since", &words.since)?, time("until", &words.until)?);
        if let (Some(since), Some(until)) = (since, until)
            && since > until
        {
            return Err(BadWord {
                field: "until",
                detail: "until: it is before since".into(),
            });
        }
        Ok(Self {
            stream: words.stream.clone(),
            consumer: words.consumer.clone(),
            reason,
            term_reason,
            since,
            until,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use async_nats::HeaderMap;
    use bytes::Bytes;

    use super::*;

    fn letter(reason: &str, term_reason: Option<&str>) -> DeadLetter {
        DeadLetter {
            store: "DLQ".into(),
            sequence: 1,
            dead_lettered_at: OffsetDateTime::UNIX_EPOCH + Duration::from_secs(100),
            reason: reason.into(),
            term_reason: term_reason.map(str::to_owned),
            stream: "ORDERS".into(),
            consumer: "billing".into(),
            stream_sequence: 7,
            subject: "orders.created".into(),
            deliveries: 1,
            published_at: None,
            payload: Bytes::new(),
            headers: HeaderMap::new(),
        }
    }

    #[test]
    fn filters_take_what_they_name() {
        let malformed = letter(REASON_TERMINATED, Some("malformed: no total"));
        let exhausted = letter(REASON_MAX_DELIVERIES, None);
        let prefix = Filter {
            term_reason: Some(TermReason::StartingWith("malformed".into())),
            ..Filter::default()
        };
        assert!(prefix.matches(&malformed));
        assert!(!prefix.matches(&exhausted));
        let exact = Filter {
            term_reason: Some(TermReason::Exactly("malformed".into())),
            ..Filter::default()
        };
        assert!(!exact.matches(&malformed));
        let by_reason = Filter {
            reason: Some(Reason::MaxDeliveries),
            consumer: Some("billing".into()),
            ..Filter::default()
        };
        assert!(by_reason.matches(&exhausted) && !by_reason.matches(&malformed));
        let at = malformed.dead_lettered_at;
        let window = Filter {
            since: Some(at),
            until: Some(at + Duration::from_secs(1)),
            ..Filter::default()
        };
        assert!(window.matches(&malformed));
        let before = Filter {
            until: Some(at),
            ..Filter::default()
        };
        assert!(!before.matches(&malformed));
        assert!(
            !Filter {
                stream: Some("OTHER".into()),
                ..Filter::default()
            }
            .matches(&malformed)
        );
    }

    #[test]
    fn filters_share_dead_letters_unless_a_word_rules_it_out() {
        let words = |json: serde_json::Value| {
            Filter::from_words(&serde_json::from_value(json).expect("words")).expect("filter")
        };
        let everything = Filter::default();
        let billing = words(serde_json::json!({"consumer": "billing"}));
        let shipping = words(serde_json::json!({"consumer": "shipping"}));
        assert!(everything.may_share(&billing) && billing.may_share(&everything));
        assert!(billing.may_share(&billing));
        assert!(!billing.may_share(&shipping));
        let malformed = words(serde_json::json!({"term_reason": "malformed*"}));
        let exact = words(serde_json::json!({"term_reason": "malformed: no total"}));
        let other = words(serde_json::json!({"term_reason": "timeout"}));
        let narrower = words(serde_json::json!({"term_reason": "malformed: no*"}));
        assert!(malformed.may_share(&exact) && exact.may_share(&malformed));
        assert!(malformed.may_share(&narrower));
        assert!(!malformed.may_share(&other) && !exact.may_share(&other));
        let terminated = words(serde_json::json!({"reason": "terminated"}));
        let exhausted = words(serde_json::json!({"reason": "max_deliveries"}));
        assert!(!terminated.may_share(&exhausted));
        let early = words(serde_json::json!({"until": "2026-01-02T00:00:00Z"}));
        let late = words(serde_json::json!({"since": "2026-01-02T00:00:00Z"}));
        let later = words(serde_json::json!({"since": "2026-01-01T00:00:00Z"}));
        assert!(!early.may_share(&late) && !late.may_share(&early));
        assert!(early.may_share(&later));
    }
}
