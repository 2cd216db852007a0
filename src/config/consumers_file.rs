//! `--consumers-file`: the TOML file that declares the consumers a gateway serves besides the
//! default one, parsed into [`ConsumerSpec`]s with every value checked as its flag would be.
//! An error names the file, the line and the key.
//!
//! May import: as the rest of `config`.

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;
use std::str::FromStr as _;
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;

use super::push::{PushEntry, PushSpec};
use super::{
    DeliverPolicy, OrderingKeySpec, parse_ack_wait, parse_dead_letter_subject, parse_filter,
    parse_name,
};

/// One `[[consumer]]` of the file: the settings the gateway creates or binds it with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumerSpec {
    pub stream: String,
    pub name: String,
    pub filter_subject: Option<String>,
    pub deliver_policy: DeliverPolicy,
    pub ack_wait: Duration,
    pub max_ack_pending: u32,
    pub max_deliver: Option<u32>,
    pub dead_letter_subject: Option<String>,
    /// Where its messages carry their ordering key: leased one at a time per key.
    pub ordering_key: Option<OrderingKeySpec>,
    /// Its `[consumer.push]` table: the gateway delivers its messages to an HTTP endpoint.
    /// Applied live when it changes (the consumer is not bound anew).
    pub push: Option<PushSpec>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    consumer: Vec<Entry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    stream: Spanned<String>,
    name: Spanned<String>,
    filter_subject: Option<Spanned<String>>,
    deliver_policy: Option<Spanned<String>>,
    ack_wait: Option<Spanned<String>>,
    max_ack_pending: Option<Spanned<i64>>,
    max_deliver: Option<Spanned<i64>>,
    dead_letter_subject: Option<Spanned<String>>,
    ordering_key: Option<Spanned<String>>,
    push: Option<PushEntry>,
}

/// Read and check the file (files it names are found relative to its directory).
pub fn load(path: &Path) -> Result<Vec<ConsumerSpec>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|err| format!("--consumers-file {}: {err}", path.display()))?;
    let base = path.parent().unwrap_or_else(|| Path::new("."));
    parse_in(&text, base).map_err(|why| format!("--consumers-file {}: {why}", path.display()))
}

/// [`parse_in`] with files relative to the working directory.
#[cfg(test)]
pub(crate) fn parse(text: &str) -> Result<Vec<ConsumerSpec>, String> {
    parse_in(text, Path::new("."))
}

/// Check the file's text, reading the files it names relative to `base`; an error says
/// `line N: key `K`: why` (for a push key, `line N: key `push.K` of consumer S/N: why`).
pub(crate) fn parse_in(text: &str, base: &Path) -> Result<Vec<ConsumerSpec>, String> {
    let file: File = toml::from_str(text).map_err(|err| {
        let message = err.message().trim_end_matches('\n');
        match err.span() {
            Some(span) => at(text, &span, &key_on_line(text, &span), message),
            None => message.to_owned(),
        }
    })?;
    let mut seen: HashMap<(String, String), usize> = HashMap::new();
    let mut specs = Vec::with_capacity(file.consumer.len());
    for entry in file.consumer {
        let spec = entry.check(text, base)?;
        let line = line_of(text, entry.name.span().start);
        if let Some(first) = seen.insert((spec.stream.clone(), spec.name.clone()), line) {
            return Err(at(
                text,
                &entry.name.span(),
                "name",
                &format!(
                    "consumer {}/{} is declared twice (first on line {first})",
                    spec.stream, spec.name
                ),
            ));
        }
        specs.push(spec);
    }
    Ok(specs)
}

impl Entry {
    fn check(&self, text: &str, base: &Path) -> Result<ConsumerSpec, String> {
        let field =
            |value: &Spanned<String>, key: &str, check: fn(&str) -> Result<String, String>| {
                check(value.get_ref()).map_err(|why| at(text, &value.span(), key, &why))
            };
        let optional = |value: &Option<Spanned<String>>,
                        key: &str,
                        check: fn(&str) -> Result<String, String>| {
            value
                .as_ref()
                .map(|value| field(value, key, check))
                .transpose()
        };
        let number = |value: &Spanned<i64>, key: &str, range: Range<i64>| {
            let number = *value.get_ref();
            if range.contains(&number) {
                u32::try_from(number).map_err(|err| at(text, &value.span(), key, &err.to_string()))
            } else {
                Err(at(
                    text,
                    &value.span(),
                    key,
                    &format!("must be from {} to {}", range.start, range.end - 1),
                ))
            }
        };
        let deliver_policy = match &self.deliver_policy {
            Some(value) => DeliverPolicy::from_str(value.get_ref())
                .map_err(|why| at(text, &value.span(), "deliver_policy", &why))?,
            None => DeliverPolicy::All,
        };
        let ack_wait = match &self.ack_wait {
            Some(value) => parse_ack_wait(value.get_ref())
                .map_err(|why| at(text, &value.span(), "ack_wait", &why))?,
            None => Duration::from_secs(30),
        };
        let stream = field(&self.stream, "stream", parse_name)?;
        let name = field(&self.name, "name", parse_name)?;
        let push = self
            .push
            .as_ref()
            .map(|push| push.check(ack_wait, base))
            .transpose()
            .map_err(|(span, key, why)| {
                let span = if span.is_empty() {
                    self.name.span()
                } else {
                    span
                };
                format!(
                    "line {}: key `push.{key}` of consumer {stream}/{name}: {why}",
                    line_of(text, span.start)
                )
            })?;
        Ok(ConsumerSpec {
            stream,
            name,
            filter_subject: optional(&self.filter_subject, "filter_subject", parse_filter)?,
            deliver_policy,
            ack_wait,
            max_ack_pending: self
                .max_ack_pending
                .as_ref()
                .map(|value| number(value, "max_ack_pending", 1..1_000_001))
                .transpose()?
                .unwrap_or(1024),
            max_deliver: self
                .max_deliver
                .as_ref()
                .map(|value| number(value, "max_deliver", 1..i64::from(u32::MAX) + 1))
                .transpose()?,
            dead_letter_subject: optional(
                &self.dead_letter_subject,
                "dead_letter_subject",
                parse_dead_letter_subject,
            )?,
            ordering_key: self
                .ordering_key
                .as_ref()
                .map(|value| {
                    OrderingKeySpec::from_str(value.get_ref())
                        .map_err(|why| at(text, &value.span(), "ordering_key", &why))
                })
                .transpose()?,
            push,
        })
    }
}

/// `line N: key `K`: why` for a value at `span`.
fn at(text: &str, span: &Range<usize>, key: &str, why: &str) -> String {
    let line = line_of(text, span.start);
    if key.is_empty() {
        format!("line {line}: {why}")
    } else {
        format!("line {line}: key `{key}`: {why}")
    }
}

/// The 1-based line of byte `offset`.
fn line_of(text: &str, offset: usize) -> usize {
    text.get(..offset.min(text.len()))
        .map_or(1, |before| before.matches('\n').count() + 1)
}

/// The key assigned on the line of `span` (`key = value`), for errors the parser reports
/// at a value.
fn key_on_line(text: &str, span: &Range<usize>) -> String {
    let start = text
        .get(..span.start.min(text.len()))
        .and_then(|before| before.rfind('\n'))
        .map_or(0, |at| at + 1);
    let line = text[start..].lines().next().unwrap_or_default();
    line.split_once('=')
        .map(|(key, _)| key.trim().trim_matches('"').to_owned())
        .filter(|key| !key.is_empty() && !key.starts_with('['))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r#"
[[consumer]]
stream = "ORDERS"
name = "shipping"
filter_subject = "orders.shipped"   # optional
deliver_policy = "all"
ack_wait = "30s"
max_ack_pending = 1024
max_deliver = 5
dead_letter_subject = "DLQ.orders"

[[consumer]]
stream = "ORDERS"
name = "analytics"
"#;

    #[test]
    fn the_documented_file_parses_with_defaults() {
        let specs = parse(FILE).expect("valid");
        assert_eq!(specs.len(), 2);
        assert_eq!(specs[0].filter_subject.as_deref(), Some("orders.shipped"));
        assert_eq!(specs[0].max_deliver, Some(5));
        assert_eq!(specs[0].dead_letter_subject.as_deref(), Some("DLQ.orders"));
        assert_eq!(specs[1].ack_wait, Duration::from_secs(30));
        assert_eq!(specs[1].max_ack_pending, 1024);
        assert_eq!(specs[1].deliver_policy, DeliverPolicy::All);
        assert_eq!(parse("").expect("empty"), Vec::new());
    }

    #[test]
    fn errors_name_the_line_and_the_key() {
        let cases = [
            (
                "[[consumer]]\nstream = \"O\"\nname = \"a\"\nack_wiat = \"3s\"\n",
                "line 4",
                "ack_wiat",
            ),
            (
                "[[consumer]]\nstream = \"O\"\nname = \"a\"\nmax_ack_pending = \"many\"\n",
                "line 4",
                "key `max_ack_pending`",
            ),
            (
                "[[consumer]]\nstream = \"O\"\nname = \"a\"\nack_wait = \"0s\"\n",
                "line 4",
                "key `ack_wait`",
            ),
            (
                "[[consumer]]\nstream = \"O\"\nname = \"a.b\"\n",
                "line 3",
                "key `name`",
            ),
            (
                "[[consumer]]\nstream = \"O\"\nname = \"a\"\n\n[[consumer]]\nstream = \"O\"\nname = \"a\"\n",
                "line 7",
                "declared twice (first on line 3)",
            ),
            (
                "[[consumer]]\nstream = \"O\"\nname = \"a\"\nmax_deliver = 0\n",
                "line 4",
                "key `max_deliver`",
            ),
            ("[[consumer]]\nstream = \"O\"\n", "line 1", "name"),
        ];
        for (text, line, says) in cases {
            let err = parse(text).expect_err(text);
            assert!(err.contains(line) && err.contains(says), "{text:?}: {err}");
        }
    }

    #[test]
    fn a_push_table_parses_with_its_defaults_and_every_mistake_names_consumer_and_key() {
        let file = "[[consumer]]\nstream = \"O\"\nname = \"a\"\n\n[consumer.push]\nurl = \"https://user:pw@example.com/hook?token=s\"\n";
        let specs = parse(file).expect("valid");
        let push = specs[0].push.as_ref().expect("a push table");
        assert_eq!(push.batch, 1);
        assert_eq!(push.timeout, Duration::from_secs(10));
        assert_eq!(push.max_in_flight, 64);
        assert_eq!(push.retry_max, Duration::from_secs(600));
        assert_eq!(push.shown_url(), "https://example.com/hook");
        let cases = [
            ("url = \"ftp://example.com\"", "push.url"),
            ("url = \"http://e\"\nformat = \"xml\"", "push.format"),
            (
                "url = \"http://e\"\nbatch = 5\nformat = \"binary\"",
                "push.batch",
            ),
            ("url = \"http://e\"\nbatch = 1001", "push.batch"),
            ("url = \"http://e\"\ntimeout = \"30s\"", "push.timeout"),
            (
                "url = \"http://e\"\nretry_initial = \"5s\"\nretry_max = \"1s\"",
                "push.retry_max",
            ),
            (
                "url = \"http://e\"\nsigning_secret_file = \"/nonexistent\"",
                "push.signing_secret_file",
            ),
            (
                "url = \"http://e\"\nheaders = { webhook-id = \"x\" }",
                "push.headers.webhook-id",
            ),
            (
                "url = \"http://e\"\nclient_cert_file = \"c.pem\"",
                "push.client_key_file",
            ),
            ("url = \"http://e\"\nretries = 3", "retries"),
        ];
        for (table, says) in cases {
            let text =
                format!("[[consumer]]\nstream = \"O\"\nname = \"a\"\n\n[consumer.push]\n{table}\n");
            let err = parse(&text).expect_err(&text);
            assert!(err.contains(says), "{text:?}: {err}");
            if says.starts_with("push.") {
                assert!(err.contains("of consumer O/a"), "{err}");
            }
        }
    }
}
