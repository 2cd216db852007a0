//! Naming consumers: a stream and consumer pair, and the `STREAM/CONSUMER` patterns that
//! `--serve-existing` and consumer-scoped tokens (`fetch:ORDERS/*`) are written in.
//!
//! May import: the rest of `domain` only.

use std::fmt;

/// One consumer of one stream.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct ConsumerName {
    pub(crate) stream: String,
    pub(crate) consumer: String,
}

impl ConsumerName {
    pub(crate) fn new(stream: &str, consumer: &str) -> Self {
        Self {
            stream: stream.to_owned(),
            consumer: consumer.to_owned(),
        }
    }
}

impl fmt::Display for ConsumerName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.stream, self.consumer)
    }
}

/// `STREAM/CONSUMER`, where `*` stands for any whole name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ConsumerPattern {
    /// `None`: any stream.
    stream: Option<String>,
    /// `None`: any consumer.
    consumer: Option<String>,
}

impl ConsumerPattern {
    /// Parse `STREAM/CONSUMER`; each side a NATS name or `*`.
    pub(crate) fn parse(text: &str) -> Result<Self, String> {
        let Some((stream, consumer)) = text.split_once('/') else {
            return Err(format!(
                "{text:?} is not STREAM/CONSUMER (e.g. ORDERS/shipping, ORDERS/*, */*)"
            ));
        };
        let side = |name: &str, what: &str| -> Result<Option<String>, String> {
            if name == "*" {
                return Ok(None);
            }
            super::subject::validate_name(name)
                .map_err(|why| format!("{text:?}: the {what} name {why} (or is `*` for any)"))?;
            Ok(Some(name.to_owned()))
        };
        Ok(Self {
            stream: side(stream, "stream")?,
            consumer: side(consumer, "consumer")?,
        })
    }

    pub(crate) fn matches(&self, name: &ConsumerName) -> bool {
        self.stream
            .as_ref()
            .is_none_or(|stream| *stream == name.stream)
            && self
                .consumer
                .as_ref()
                .is_none_or(|consumer| *consumer == name.consumer)
    }
}

impl fmt::Display for ConsumerPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let side = |name: &Option<String>| name.clone().unwrap_or_else(|| "*".into());
        write!(f, "{}/{}", side(&self.stream), side(&self.consumer))
    }
}

/// Comma-separated patterns (`--serve-existing`); none matches nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConsumerPatterns(Vec<ConsumerPattern>);

impl ConsumerPatterns {
    pub(crate) fn parse(text: &str) -> Result<Self, String> {
        let patterns = text
            .split(',')
            .map(str::trim)
            .filter(|pattern| !pattern.is_empty())
            .map(ConsumerPattern::parse)
            .collect::<Result<Vec<_>, _>>()?;
        if patterns.is_empty() {
            return Err("names no pattern: give STREAM/CONSUMER, e.g. ORDERS/* or */*".into());
        }
        Ok(Self(patterns))
    }

    pub(crate) fn matches(&self, name: &ConsumerName) -> bool {
        self.0.iter().any(|pattern| pattern.matches(name))
    }

    /// Whether some consumer of `stream` matches (a pattern names that stream, or any).
    pub(crate) fn matches_stream(&self, stream: &str) -> bool {
        self.0
            .iter()
            .any(|pattern| pattern.stream.as_ref().is_none_or(|named| named == stream))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_matches_when_some_pattern_names_it_or_any() {
        let patterns = ConsumerPatterns::parse("ORDERS/*").expect("valid");
        assert!(patterns.matches_stream("ORDERS"));
        assert!(!patterns.matches_stream("EVENTS"));
        assert!(
            ConsumerPatterns::parse("*/audit")
                .expect("valid")
                .matches_stream("EVENTS")
        );
    }

    #[test]
    fn patterns_match_whole_names() {
        let patterns = ConsumerPatterns::parse("ORDERS/*, */audit").expect("valid");
        let yes = [("ORDERS", "shipping"), ("ORDERS", "x"), ("EVENTS", "audit")];
        let no = [
            ("ORDERS2", "shipping"),
            ("EVENTS", "audit2"),
            ("EVENTS", "x"),
        ];
        for (stream, consumer) in yes {
            assert!(patterns.matches(&ConsumerName::new(stream, consumer)));
        }
        for (stream, consumer) in no {
            assert!(!patterns.matches(&ConsumerName::new(stream, consumer)));
        }
        assert!(
            ConsumerPatterns::parse("*/*")
                .expect("valid")
                .matches(&ConsumerName::new("A", "b"))
        );
    }

    #[test]
    fn bad_patterns_say_why() {
        for (text, says) in [
            ("ORDERS", "STREAM/CONSUMER"),
            ("ORD*/x", "stream name"),
            ("ORDERS/a.b", "consumer name"),
            (" , ", "no pattern"),
        ] {
            let err = ConsumerPatterns::parse(text).expect_err(text);
            assert!(err.contains(says), "{text}: {err}");
        }
    }
}
