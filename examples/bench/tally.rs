//! Bookkeeping shared by the drain loops of one run: which stream sequences were acked,
//! when the target was met, the gateway's CPU meanwhile; and running the loops together.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{anyhow, ensure};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::outcome::{GatewayFigures, Outcome, Run};
use super::process_stats::cpu_seconds;
use super::stats::{micros, percentile};

/// A drain that acks nothing for this long has stalled: fail instead of hanging.
const STALL_DEADLINE: Duration = Duration::from_secs(30);

/// Which stream sequences were acked (each at most once), when the target was reached, and
/// counters. Loops stop fetching once `total` messages are acked; what they already hold
/// they still ack.
pub(crate) struct Tally {
    total: u64,
    started: Instant,
    /// The gateway process, whose CPU time is read at the start and when the target is met.
    gateway_pid: Option<u32>,
    cpu_at_start: Option<f64>,
    state: Mutex<TallyState>,
    fetches: AtomicU64,
    redelivered: AtomicU64,
}

struct TallyState {
    acked: Vec<bool>,
    count: u64,
    last_progress: Instant,
    done_at: Option<Instant>,
    cpu_at_done: Option<f64>,
    /// Round-trip times in µs: non-empty fetches, and ack rounds (one per fetch).
    fetch_micros: Vec<u32>,
    ack_micros: Vec<u32>,
}

impl Tally {
    pub(crate) fn new(total: u64, stream_len: u64, gateway_pid: Option<u32>) -> Self {
        let now = Instant::now();
        Self {
            total,
            started: now,
            gateway_pid,
            cpu_at_start: gateway_pid.and_then(cpu_seconds),
            state: Mutex::new(TallyState {
                acked: vec![false; stream_len as usize],
                count: 0,
                last_progress: now,
                done_at: None,
                cpu_at_done: None,
                fetch_micros: Vec::new(),
                ack_micros: Vec::new(),
            }),
            fetches: AtomicU64::new(0),
            redelivered: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, TallyState> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(crate) fn is_done(&self) -> bool {
        self.lock().count >= self.total
    }

    /// Count one fetch answer; `delivered` is each message's delivery count.
    pub(crate) fn fetched(&self, delivered: impl Iterator<Item = u64>, waited: Duration) {
        let redelivered = delivered.filter(|&delivered| delivered > 1).count() as u64;
        self.fetches.fetch_add(1, Ordering::Relaxed);
        self.redelivered.fetch_add(redelivered, Ordering::Relaxed);
        self.lock().fetch_micros.push(micros(waited));
    }

    /// Record confirmed acks of `sequences`, which took `waited`.
    pub(crate) fn acked(&self, sequences: &[u64], waited: Duration) -> anyhow::Result<()> {
        let now = Instant::now();
        let mut state = self.lock();
        state.ack_micros.push(micros(waited));
        for &sequence in sequences {
            let len = state.acked.len() as u64;
            ensure!(
                (1..=len).contains(&sequence),
                "acked stream sequence {sequence}, outside 1..={len}"
            );
            let slot = &mut state.acked[(sequence - 1) as usize];
            ensure!(!*slot, "stream sequence {sequence} was acked twice");
            *slot = true;
            state.count += 1;
        }
        if !sequences.is_empty() {
            state.last_progress = now;
        }
        if state.count >= self.total && state.done_at.is_none() {
            state.done_at = Some(now);
            state.cpu_at_done = self.gateway_pid.and_then(cpu_seconds);
        }
        Ok(())
    }

    /// After an empty fetch: fail when nothing was acked for too long.
    pub(crate) fn check_stall(&self) -> anyhow::Result<()> {
        let state = self.lock();
        let idle = state.last_progress.elapsed();
        ensure!(
            idle < STALL_DEADLINE,
            "stalled: no ack for {idle:.1?} with {} of {} messages acked",
            state.count,
            self.total
        );
        Ok(())
    }

    /// The run's outcome; fails unless the target was reached.
    pub(crate) fn finish(&self, run: Run) -> anyhow::Result<Outcome> {
        let mut state = self.lock();
        ensure!(
            state.count >= self.total,
            "{} of {} messages acked",
            state.count,
            self.total
        );
        let done_at = state
            .done_at
            .ok_or_else(|| anyhow!("all messages acked but no completion time recorded"))?;
        let redelivered = self.redelivered.load(Ordering::Relaxed);
        ensure!(
            redelivered == 0,
            "{redelivered} deliveries were redeliveries"
        );
        let cpu = match (self.cpu_at_start, state.cpu_at_done) {
            (Some(start), Some(end)) => Some(end - start),
            _ => None,
        };
        Ok(Outcome {
            run,
            round: 0,
            messages: self.total,
            acked: state.count,
            seconds: (done_at - self.started).as_secs_f64(),
            fetches: self.fetches.load(Ordering::Relaxed),
            fetch_p99_ms: percentile(&mut state.fetch_micros, 0.99),
            ack_p99_ms: percentile(&mut state.ack_micros, 0.99),
            native_cpu_seconds: None,
            gateway: cpu.map(|cpu_seconds| GatewayFigures {
                cpu_seconds,
                requests: 0,
                log_lines: 0,
                log_bytes: 0,
                rss_kb: None,
            }),
        })
    }
}

/// Run `clients` drain loops to completion; the first error wins.
pub(crate) async fn run_loops<F, Fut>(clients: u32, make_loop: F) -> anyhow::Result<()>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let handles: Vec<JoinHandle<anyhow::Result<()>>> = (0..clients as usize)
        .map(|client| tokio::spawn(make_loop(client)))
        .collect();
    let mut first_error = None;
    for (client, handle) in handles.into_iter().enumerate() {
        let result = match handle.await {
            Ok(result) => result,
            Err(err) => Err(anyhow!("drain loop panicked or was cancelled: {err}")),
        };
        if let Err(err) = result
            && first_error.is_none()
        {
            first_error = Some(err.context(format!("drain loop {client}")));
        }
    }
    first_error.map_or(Ok(()), Err)
}
