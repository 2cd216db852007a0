//! Statistics over the samples the runs take: µs samples, their quantiles in ms, and the
//! median of the rounds.

use std::time::Duration;

/// A p50 and a p99, in ms.
pub(crate) type Percentiles = (f64, f64);

pub(crate) fn micros(duration: Duration) -> u32 {
    u32::try_from(duration.as_micros()).unwrap_or(u32::MAX)
}

/// The `q` quantile of `samples` (µs) in ms; 0 when there are none.
pub(crate) fn percentile(samples: &mut [u32], q: f64) -> f64 {
    if samples.is_empty() {
        return 0.0;
    }
    samples.sort_unstable();
    let index = ((samples.len() as f64 * q).ceil() as usize).clamp(1, samples.len()) - 1;
    f64::from(samples[index]) / 1e3
}

pub(crate) fn median(mut values: Vec<f64>) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => None,
        n if n % 2 == 1 => Some(values[n / 2]),
        n => Some((values[n / 2 - 1] + values[n / 2]) / 2.0),
    }
}
