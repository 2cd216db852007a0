//! The settle directives a push endpoint writes — a `Ruststream-Settle` header, a batch
//! answer's results — read strictly: a directive the gateway cannot read is [`Unreadable`],
//! so that the rules that judge an answer never take a typo for an ack.
//!
//! May import: the rest of `domain` only.

use std::time::Duration;

/// What becomes of the message (each of a batch, when its answer does not say per message).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Settle {
    Ack,
    /// Left leased: the endpoint settles it itself through the usual routes.
    Later,
    Nak(Duration),
    Term(String),
}

/// The longest nak delay an endpoint may ask for: a week, as `POST …/nak`'s `delay_ms`.
pub(crate) const MOST_NAK_DELAY: Duration = Duration::from_secs(7 * 24 * 3600);
/// The reason of a term the endpoint asked for without one.
const ENDPOINT_TERM: &str = "push: terminated by the endpoint";

/// A settle directive (a `Ruststream-Settle` header, a batch result) the gateway cannot read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Unreadable;

/// The settle a `Ruststream-Settle` header asks for: `ack`, `nak`, `nak; delay=<ms>`
/// (decimal digits, at most [`MOST_NAK_DELAY`]), `term`, `term; reason=<text>`, and on a 2xx
/// `later` (`Ok(None)` on another status: the status then decides). Directive and parameter
/// names are case-insensitive. Anything else — an unknown directive, a parameter a
/// directive does not take, a delay that is negative, fractional, with a unit or too large —
/// is [`Unreadable`].
pub(crate) fn asked_for(value: &str, success: bool) -> Result<Option<Settle>, Unreadable> {
    let (directive, parameter) = match value.split_once(';') {
        Some((directive, parameter)) => {
            let (name, value) = parameter.split_once('=').ok_or(Unreadable)?;
            (
                directive,
                Some((name.trim().to_ascii_lowercase(), value.trim())),
            )
        }
        None => (value, None),
    };
    let directive = directive.trim().to_ascii_lowercase();
    match (directive.as_str(), parameter) {
        ("ack", None) => Ok(Some(Settle::Ack)),
        ("later", None) => Ok(success.then_some(Settle::Later)),
        ("nak", None) => Ok(Some(Settle::Nak(Duration::ZERO))),
        ("nak", Some((name, value))) if name == "delay" => {
            nak_delay_ms(value).map(|delay| Some(Settle::Nak(delay)))
        }
        ("term", None) => Ok(Some(Settle::Term(ENDPOINT_TERM.into()))),
        ("term", Some((name, value))) if name == "reason" => {
            Ok(Some(Settle::Term(endpoint_reason(value.trim_matches('"')))))
        }
        _ => Err(Unreadable),
    }
}

/// A nak delay in milliseconds, as written: decimal digits only (no sign, no fraction, no
/// unit), at most [`MOST_NAK_DELAY`].
pub(crate) fn nak_delay_ms(value: &str) -> Result<Duration, Unreadable> {
    if value.is_empty() || !value.bytes().all(|byte| byte.is_ascii_digit()) {
        return Err(Unreadable);
    }
    let ms: u64 = value.parse().map_err(|_| Unreadable)?;
    let delay = Duration::from_millis(ms);
    if delay > MOST_NAK_DELAY {
        return Err(Unreadable);
    }
    Ok(delay)
}

/// A batch result's settle: `"ack"`, `"nak"` (with `delay_ms`, at most [`MOST_NAK_DELAY`]),
/// `"term"` (with `reason`); anything else is [`Unreadable`].
pub(crate) fn batch_result(
    settle: &str,
    delay_ms: Option<u64>,
    reason: Option<&str>,
) -> Result<Settle, Unreadable> {
    match settle {
        "ack" => Ok(Settle::Ack),
        "nak" => {
            let delay = Duration::from_millis(delay_ms.unwrap_or(0));
            if delay > MOST_NAK_DELAY {
                return Err(Unreadable);
            }
            Ok(Settle::Nak(delay))
        }
        "term" => Ok(Settle::Term(
            reason.map_or_else(|| ENDPOINT_TERM.to_owned(), str::to_owned),
        )),
        _ => Err(Unreadable),
    }
}

/// The longest term reason an endpoint may give, as `POST …/term`'s.
const MOST_REASON_CHARS: usize = 1024;

/// A term reason the endpoint gave, as it travels in the `+TERM` payload (one line to NATS)
/// and a dead letter's header: control characters become spaces, and it is cut to
/// [`MOST_REASON_CHARS`].
pub(crate) fn endpoint_reason(reason: &str) -> String {
    cut(reason, MOST_REASON_CHARS)
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

/// At most `most` characters of `text` (cut on a character boundary), for a log line.
pub(crate) fn cut(text: &str, most: usize) -> &str {
    match text.char_indices().nth(most) {
        Some((at, _)) => &text[..at],
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_settle_header_reads_every_valid_form() {
        let read = |value: &str| asked_for(value, true);
        assert_eq!(read("ack"), Ok(Some(Settle::Ack)));
        assert_eq!(read(" ACK "), Ok(Some(Settle::Ack)));
        assert_eq!(read("later"), Ok(Some(Settle::Later)));
        assert_eq!(asked_for("later", false), Ok(None));
        assert_eq!(read("nak"), Ok(Some(Settle::Nak(Duration::ZERO))));
        assert_eq!(
            read("nak; delay=2500"),
            Ok(Some(Settle::Nak(Duration::from_millis(2500))))
        );
        assert_eq!(
            read("Nak ;Delay = 0"),
            Ok(Some(Settle::Nak(Duration::ZERO)))
        );
        assert_eq!(
            read("nak; delay=604800000"),
            Ok(Some(Settle::Nak(MOST_NAK_DELAY)))
        );
        assert_eq!(read("term"), Ok(Some(Settle::Term(ENDPOINT_TERM.into()))));
        assert_eq!(
            read("term; reason=\"bad; order\""),
            Ok(Some(Settle::Term("bad; order".into())))
        );
    }

    #[test]
    fn batch_results_are_read_as_strictly_and_reasons_kept_to_one_line() {
        assert_eq!(batch_result("ack", Some(5), None), Ok(Settle::Ack));
        assert_eq!(
            batch_result("nak", Some(250), None),
            Ok(Settle::Nak(Duration::from_millis(250)))
        );
        assert_eq!(batch_result("nak", Some(u64::MAX), None), Err(Unreadable));
        assert_eq!(batch_result("retry", None, None), Err(Unreadable));
        assert_eq!(
            batch_result("term", None, Some("bad")),
            Ok(Settle::Term("bad".into()))
        );
        assert_eq!(endpoint_reason("two\nlines\r"), "two lines ");
        assert_eq!(endpoint_reason(&"é".repeat(2000)).chars().count(), 1024);
    }

    #[test]
    fn cut_keeps_whole_characters() {
        assert_eq!(cut("héllo", 2), "hé");
        assert_eq!(cut("héllo", 10), "héllo");
        assert_eq!(cut(&"日本".repeat(300), 256).chars().count(), 256);
    }
}
