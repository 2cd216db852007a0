//! `GET /metrics` read as a test reads it: one scrape, every sample line by series.
//!
//! Per-consumer series carry `stream` and `consumer` labels. [`Scrape::get`] and its kin
//! read a series with those two labels left out — the sum over the consumers, which for a
//! gateway of one consumer is that consumer's value — and [`Scrape::exact`] one series as
//! written.

use std::collections::BTreeMap;

use super::client::Client;

/// One scrape: every sample line, `name{labels}` → value.
pub struct Scrape {
    /// By series without the `stream` and `consumer` labels, summed over them.
    samples: BTreeMap<String, f64>,
    /// By series as written.
    exact: BTreeMap<String, f64>,
    pub text: String,
}

impl Scrape {
    pub async fn of(gateway: &Client) -> Self {
        let reply = gateway.get("/metrics").await;
        assert_eq!(reply.status, 200, "GET /metrics: {}", reply.text);
        assert!(
            reply
                .content_type()
                .starts_with("text/plain; version=0.0.4"),
            "Prometheus text format, got {:?}",
            reply.content_type()
        );
        let exact: BTreeMap<String, f64> = reply
            .text
            .lines()
            .filter(|line| !line.starts_with('#') && !line.trim().is_empty())
            .map(|line| {
                let (series, value) = line
                    .rsplit_once(' ')
                    .unwrap_or_else(|| panic!("not a sample line: {line:?}"));
                let value = value
                    .parse::<f64>()
                    .unwrap_or_else(|err| panic!("bad value in {line:?}: {err}"));
                (series.to_owned(), value)
            })
            .collect();
        let mut samples = BTreeMap::new();
        for (series, value) in &exact {
            *samples.entry(without_consumer(series)).or_insert(0.0) += value;
        }
        Self {
            samples,
            exact,
            text: reply.text,
        }
    }

    /// One series exactly as written (labels in the order Prometheus sorts them: by name).
    #[track_caller]
    pub fn exact(&self, series: &str) -> f64 {
        *self
            .exact
            .get(series)
            .unwrap_or_else(|| panic!("no series {series} in:\n{}", self.text))
    }

    /// One consumer's series: `name` with `labels` (`k="v"` pairs, comma-separated, or
    /// empty) and that consumer's `stream` and `consumer` labels.
    #[track_caller]
    pub fn of_consumer(&self, name: &str, labels: &str, stream: &str, consumer: &str) -> f64 {
        let mut pairs: Vec<String> = split_labels(labels);
        pairs.push(format!("consumer=\"{consumer}\""));
        pairs.push(format!("stream=\"{stream}\""));
        pairs.sort();
        self.exact(&format!("{name}{{{}}}", pairs.join(",")))
    }

    /// A series' value; panics when the series is missing (every one is listed from the start).
    #[track_caller]
    pub fn get(&self, series: &str) -> f64 {
        *self
            .samples
            .get(series)
            .unwrap_or_else(|| panic!("no series {series} in:\n{}", self.text))
    }

    /// A series' value, 0 when not listed yet (labelled series appear on first use).
    pub fn get_or_zero(&self, series: &str) -> f64 {
        self.samples.get(series).copied().unwrap_or(0.0)
    }

    /// The sum of every series whose name and labels start with `prefix`.
    pub fn sum(&self, prefix: &str) -> f64 {
        self.samples
            .iter()
            .filter(|(series, _)| series.starts_with(prefix))
            .map(|(_, value)| value)
            .sum()
    }
}

/// `series` without its `stream` and `consumer` labels.
fn without_consumer(series: &str) -> String {
    let Some((name, labels)) = series.split_once('{') else {
        return series.to_owned();
    };
    let labels = labels.strip_suffix('}').unwrap_or(labels);
    let kept: Vec<String> = split_labels(labels)
        .into_iter()
        .filter(|pair| !pair.starts_with("stream=\"") && !pair.starts_with("consumer=\""))
        .collect();
    if kept.is_empty() {
        name.to_owned()
    } else {
        format!("{name}{{{}}}", kept.join(","))
    }
}

/// `a="x",b="y"` → its pairs, commas inside quoted values kept.
fn split_labels(labels: &str) -> Vec<String> {
    let mut pairs = Vec::new();
    let mut current = String::new();
    let (mut quoted, mut escaped) = (false, false);
    for c in labels.chars() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            ',' if !quoted => {
                pairs.push(std::mem::take(&mut current));
                continue;
            }
            _ => {}
        }
        current.push(c);
    }
    if !current.is_empty() {
        pairs.push(current);
    }
    pairs
}
