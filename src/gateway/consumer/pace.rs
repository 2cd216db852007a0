//! How fast a stream's client settles what it is sent, and so how much its pull may ask the
//! server for beyond the slice the stream leases at a time.
//!
//! A stream's pull asking only for the slice it leases ends with that slice, and the next
//! slice waits for a pull of its own (on the WebSocket one-op path that cost about a sixth of
//! the throughput). Asking for the stream's whole credit instead brings, between two steps,
//! messages nobody has leased yet: they are held for the next step or fetch and nak'd if none
//! takes them within the hold — a delivery spent at the server, each time nearer
//! `max_deliver`. So the pull asks beyond the slice only what the client settled within the
//! last half hold: at the pace it keeps, the next steps take that surplus well inside the
//! hold, and a client that slows down (or stops) soon asks for its slice alone again.
//!
//! May import: nothing of the gateway.

use std::time::Duration;

use tokio::time::Instant;

/// What a stream's client settled lately: in the window running now and the one before.
#[derive(Debug, Default)]
pub(crate) struct Pace {
    window_began: Option<Instant>,
    this_window: usize,
    last_window: usize,
}

impl Pace {
    /// `count` of the stream's leases ended by a settle at `now`; `window` is half the hold.
    pub(crate) fn settled(&mut self, count: usize, now: Instant, window: Duration) {
        let began = *self.window_began.get_or_insert(now);
        let elapsed = now.saturating_duration_since(began);
        if elapsed >= window {
            // A window with nothing settled since the last one ended counts as none.
            self.last_window = if elapsed >= window * 2 {
                0
            } else {
                self.this_window
            };
            self.this_window = 0;
            self.window_began = Some(now);
        }
        self.this_window += count;
    }

    /// What a pull may ask for: `batch`, and beyond it as many as the client settled within
    /// a window lately, never more than the stream's `credit`.
    pub(crate) fn pull_credit(&self, credit: usize, batch: usize) -> usize {
        let recent = self.this_window.max(self.last_window);
        credit.min(batch.max(recent)).max(batch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WINDOW: Duration = Duration::from_secs(1);

    #[test]
    fn a_stream_nobody_settled_for_asks_for_its_slice_alone() {
        let pace = Pace::default();
        assert_eq!(pace.pull_credit(1000, 100), 100);
    }

    #[test]
    fn a_client_keeping_up_has_its_pull_ask_up_to_the_credit() {
        let now = Instant::now();
        let mut pace = Pace::default();
        pace.settled(400, now, WINDOW);
        assert_eq!(pace.pull_credit(1000, 100), 400);
        pace.settled(5000, now + Duration::from_millis(10), WINDOW);
        assert_eq!(pace.pull_credit(1000, 100), 1000, "never beyond the credit");
        // The window just ended still counts while the new one fills.
        pace.settled(10, now + WINDOW, WINDOW);
        assert_eq!(pace.pull_credit(1000, 100), 1000);
    }

    #[test]
    fn a_client_that_slows_down_soon_asks_for_its_slice_again() {
        let now = Instant::now();
        let mut pace = Pace::default();
        pace.settled(900, now, WINDOW);
        pace.settled(3, now + WINDOW, WINDOW);
        assert_eq!(pace.pull_credit(1000, 100), 900, "the window just ended");
        pace.settled(2, now + WINDOW * 2, WINDOW);
        assert_eq!(
            pace.pull_credit(1000, 100),
            100,
            "three settled in the last window"
        );
        // Silent for longer than two windows: what it did before does not count.
        let mut quiet = Pace::default();
        quiet.settled(900, now, WINDOW);
        quiet.settled(0, now + WINDOW * 3, WINDOW);
        assert_eq!(quiet.pull_credit(1000, 100), 100);
    }

    #[test]
    fn a_batch_above_the_credit_is_kept_as_asked() {
        let pace = Pace::default();
        assert_eq!(pace.pull_credit(50, 100), 100);
    }
}
