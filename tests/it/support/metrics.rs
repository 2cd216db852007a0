//! `GET /metrics` read as a test reads it: one scrape, every sample line by series.

use std::collections::BTreeMap;

use super::client::Client;

/// One scrape: every sample line, `name{labels}` → value.
pub struct Scrape {
    samples: BTreeMap<String, f64>,
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
        let samples = reply
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
        Self {
            samples,
            text: reply.text,
        }
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
