//! Reading the dead-letter stream without changing it: which streams hold the dead letters
//! (found by the subjects they capture, not assumed), one dead letter by its sequence, and
//! pages of them, oldest or newest first, filtered by what [`super::dead_letter`] wrote into
//! their headers.
//!
//! A page is read by a short-lived ephemeral consumer that acknowledges nothing (deleted
//! after the read, or by the server soon after a crashed one), never by a durable one: the
//! dead-letter stream and its consumers are exactly as they were. Newest first reads the
//! stream backwards in windows, each read forwards and turned around.
//!
//! What a dead letter is lives in [`letter`], which of them a filter takes in [`filter`];
//! this module reads the stream.
//!
//! May import: `domain`. Nothing of the gateway above the NATS boundary.

mod filter;
mod letter;

use std::collections::VecDeque;
use std::time::Duration;

use anyhow::Context as _;
use async_nats::jetstream::{self, consumer, stream::RawMessageErrorKind};

use futures::StreamExt as _;

use super::API_TIMEOUT;

pub(crate) use filter::{Filter, FilterWords};
pub(crate) use letter::DeadLetter;

/// Messages one ephemeral reader asks for at once, and the width of a backward window.
const WINDOW: u64 = 1000;
/// How long a reader that was not deleted (a crash mid-read) outlives its last use.
const READER_INACTIVE: Duration = Duration::from_secs(10);
/// Messages one request looks at before it answers with what it found so far and a cursor:
/// a filter matching nothing in a huge stream answers in bounded time.
pub(crate) const SCAN_BUDGET: usize = 50_000;

/// Which end a listing starts from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum Order {
    #[default]
    NewestFirst,
    OldestFirst,
}

/// One stream's part of a page.
#[derive(Debug, Default)]
pub(crate) struct Page {
    pub(crate) letters: Vec<DeadLetter>,
    /// Where the next page of this stream begins: oldest first, the next sequence to read;
    /// newest first, the sequence it reads below. `None`: nothing further matches here.
    pub(crate) next: Option<u64>,
}

/// The streams that store what is published to `subjects`, each once, by name.
pub(crate) async fn stores(
    js: &jetstream::Context,
    subjects: impl IntoIterator<Item = &str>,
) -> anyhow::Result<Vec<String>> {
    let mut stores = Vec::new();
    for subject in subjects {
        if let Some(store) = super::publish::stream_capturing(js, subject)
            .await
            .map_err(|err| anyhow::anyhow!("{err:?}"))?
        {
            stores.push(store);
        }
    }
    stores.sort();
    stores.dedup();
    Ok(stores)
}

/// The dead letter at `sequence` of `store`; `None` when there is none (removed, or not a
/// dead letter).
pub(crate) async fn get(
    js: &jetstream::Context,
    store: &str,
    sequence: u64,
) -> anyhow::Result<Option<DeadLetter>> {
    let stream = tokio::time::timeout(API_TIMEOUT, js.get_stream_no_info(store))
        .await
        .context("timed out looking up the dead-letter stream")?
        .context("looking up the dead-letter stream")?;
    let message = tokio::time::timeout(API_TIMEOUT, stream.get_raw_message(sequence))
        .await
        .context("timed out reading the dead letter")?;
    match message {
        Ok(message) => Ok(DeadLetter::read(
            store,
            message.sequence,
            message.time,
            Some(&message.headers),
            message.payload,
        )),
        Err(err) if err.kind() == RawMessageErrorKind::NoMessageFound => Ok(None),
        Err(err) => Err(anyhow::Error::new(err).context("reading the dead letter")),
    }
}

/// Up to `limit` dead letters of `store` that `filter` takes, from `from` on (a cursor's
/// sequence; `None`: the end `order` starts from), looking at no more than `budget` messages
/// (what was looked at is taken from it).
pub(crate) async fn page(
    js: &jetstream::Context,
    store: &str,
    order: Order,
    from: Option<u64>,
    filter: &Filter,
    limit: usize,
    budget: &mut usize,
) -> anyhow::Result<Page> {
    let stream = tokio::time::timeout(API_TIMEOUT, js.get_stream(store))
        .await
        .context("timed out reading the dead-letter stream's info")?
        .context("reading the dead-letter stream's info")?;
    let state = stream.cached_info().state.clone();
    if state.messages == 0 || limit == 0 {
        return Ok(Page::default());
    }
    let reader = Reader { stream, store };
    match order {
        Order::OldestFirst => {
            let mut start = from
                .unwrap_or(state.first_sequence)
                .max(state.first_sequence);
            if let Some(since) = filter.since {
                match super::seek::first_at_or_after(js, store, since).await? {
                    Some(first) => start = start.max(first),
                    None => return Ok(Page::default()),
                }
            }
            reader
                .forwards(start, state.last_sequence, filter, limit, budget)
                .await
        }
        Order::NewestFirst => {
            let mut below = from.unwrap_or(u64::MAX).min(state.last_sequence + 1);
            if let Some(until) = filter.until
                && let Some(first) = super::seek::first_at_or_after(js, store, until).await?
            {
                below = below.min(first);
            }
            reader
                .backwards(state.first_sequence, below, filter, limit, budget)
                .await
        }
    }
}

/// A dead-letter stream's last sequence now, and how many replicas it has.
pub(crate) async fn extent(js: &jetstream::Context, store: &str) -> anyhow::Result<(u64, usize)> {
    let stream = tokio::time::timeout(API_TIMEOUT, js.get_stream(store))
        .await
        .context("timed out reading the dead-letter stream's info")?
        .context("reading the dead-letter stream's info")?;
    let info = stream.cached_info();
    Ok((info.state.last_sequence, info.config.num_replicas))
}

/// How many dead letters of `store` up to `last` `filter` takes (every one is looked at).
pub(crate) async fn count(
    js: &jetstream::Context,
    store: &str,
    filter: &Filter,
    last: u64,
) -> anyhow::Result<u64> {
    let stream = tokio::time::timeout(API_TIMEOUT, js.get_stream(store))
        .await
        .context("timed out reading the dead-letter stream's info")?
        .context("reading the dead-letter stream's info")?;
    let first = stream.cached_info().state.first_sequence;
    if stream.cached_info().state.messages == 0 || first > last {
        return Ok(0);
    }
    let reader = Reader { stream, store };
    let mut budget = usize::MAX;
    let pass = reader
        .pass(first, last + 1, filter, Keep::Last(0), &mut budget)
        .await?;
    Ok(pass.matched)
}

/// What reads one dead-letter stream.
struct Reader<'a> {
    stream: jetstream::stream::Stream,
    store: &'a str,
}

/// What one pass over a run of sequences found.
struct Pass {
    /// The matches, in stream order (the last `keep` of them).
    found: VecDeque<DeadLetter>,
    /// The sequence after the last message looked at.
    reached: u64,
    /// The filter's time bound was passed (reading forwards, `until`; reading a window
    /// backwards, `since`): nothing further in this direction can match.
    past_bound: bool,
    /// The budget ran out before the run did.
    out_of_budget: bool,
    /// How many matched, kept or not.
    matched: u64,
}

impl Reader<'_> {
    async fn forwards(
        &self,
        start: u64,
        last: u64,
        filter: &Filter,
        limit: usize,
        budget: &mut usize,
    ) -> anyhow::Result<Page> {
        if start > last {
            return Ok(Page::default());
        }
        let pass = self
            .pass(start, last + 1, filter, Keep::First(limit), budget)
            .await?;
        let full = pass.found.len() >= limit;
        let letters: Vec<DeadLetter> = pass.found.into_iter().collect();
        let next = if pass.past_bound {
            None
        } else if full {
            letters.last().map(|last| last.sequence + 1)
        } else if pass.out_of_budget {
            Some(pass.reached)
        } else {
            None
        };
        Ok(Page {
            next: next.filter(|next| *next <= last),
            letters,
        })
    }

    async fn backwards(
        &self,
        first: u64,
        mut below: u64,
        filter: &Filter,
        limit: usize,
        budget: &mut usize,
    ) -> anyhow::Result<Page> {
        let mut letters = Vec::new();
        while below > first {
            let from = below.saturating_sub(WINDOW).max(first);
            let wanted = limit - letters.len();
            let pass = self
                .pass(from, below, filter, Keep::Last(wanted), budget)
                .await?;
            let window_seen = !pass.out_of_budget;
            letters.extend(pass.found.into_iter().rev());
            if letters.len() >= limit {
                let next = letters.last().map(|last| last.sequence);
                return Ok(Page {
                    next: next.filter(|next| *next > first),
                    letters,
                });
            }
            if pass.past_bound {
                return Ok(Page {
                    letters,
                    next: None,
                });
            }
            if !window_seen {
                // Budget gone within this window: it is read again from its top next time.
                return Ok(Page {
                    letters,
                    next: Some(below),
                });
            }
            below = from;
        }
        Ok(Page {
            letters,
            next: None,
        })
    }

    /// Read `[from, below)` forwards, keeping the matches `keep` says.
    async fn pass(
        &self,
        from: u64,
        below: u64,
        filter: &Filter,
        keep: Keep,
        budget: &mut usize,
    ) -> anyhow::Result<Pass> {
        let config = consumer::pull::Config {
            deliver_policy: consumer::DeliverPolicy::ByStartSequence {
                start_sequence: from,
            },
            ack_policy: consumer::AckPolicy::None,
            inactive_threshold: READER_INACTIVE,
            memory_storage: true,
            num_replicas: 1,
            ..Default::default()
        };
        let reader = tokio::time::timeout(API_TIMEOUT, self.stream.create_consumer(config))
            .await
            .context("timed out making a reader of the dead-letter stream")?
            .context("making a reader of the dead-letter stream")?;
        let name = reader.cached_info().name.clone();
        let read = self.read(&reader, below, filter, keep, budget).await;
        let stream = self.stream.clone();
        // The answer need not wait for the reader's removal; the server ends it anyway.
        tokio::spawn(async move {
            let _ = tokio::time::timeout(API_TIMEOUT, stream.delete_consumer(&name)).await;
        });
        read.map(|mut pass| {
            pass.reached = pass.reached.max(from);
            pass
        })
    }

    async fn read(
        &self,
        reader: &consumer::PullConsumer,
        below: u64,
        filter: &Filter,
        keep: Keep,
        budget: &mut usize,
    ) -> anyhow::Result<Pass> {
        let mut pass = Pass {
            found: VecDeque::new(),
            reached: 0,
            past_bound: false,
            out_of_budget: false,
            matched: 0,
        };
        loop {
            if *budget == 0 {
                pass.out_of_budget = true;
                return Ok(pass);
            }
            let asked = (*budget as u64).min(WINDOW);
            let mut batch = tokio::time::timeout(
                API_TIMEOUT,
                reader.fetch().max_messages(asked as usize).messages(),
            )
            .await
            .context("timed out reading the dead-letter stream")?
            .context("reading the dead-letter stream")?;
            let mut got = 0u64;
            while let Some(message) = tokio::time::timeout(API_TIMEOUT, batch.next())
                .await
                .context("timed out reading the dead-letter stream")?
            {
                let message = message
                    .map_err(|err| anyhow::anyhow!("reading the dead-letter stream: {err}"))?;
                got += 1;
                let info = message
                    .info()
                    .map_err(|err| anyhow::anyhow!("a delivery without metadata: {err}"))?;
                let (sequence, stored_at, pending) =
                    (info.stream_sequence, info.published, info.pending);
                if sequence >= below {
                    return Ok(pass);
                }
                *budget = budget.saturating_sub(1);
                pass.reached = sequence + 1;
                let message = message.message;
                if let Some(letter) = DeadLetter::read(
                    self.store,
                    sequence,
                    stored_at,
                    message.headers.as_ref(),
                    message.payload,
                ) {
                    match keep {
                        Keep::First(_) if filter.until.is_some_and(|until| stored_at >= until) => {
                            pass.past_bound = true;
                            return Ok(pass);
                        }
                        // The rest of the window is read: its later messages may match.
                        Keep::Last(_) if filter.since.is_some_and(|since| stored_at < since) => {
                            pass.past_bound = true;
                        }
                        _ => {}
                    }
                    if filter.matches(&letter) {
                        pass.matched += 1;
                        pass.found.push_back(letter);
                        match keep {
                            Keep::First(limit) if pass.found.len() >= limit => return Ok(pass),
                            Keep::Last(limit) if pass.found.len() > limit => {
                                pass.found.pop_front();
                            }
                            _ => {}
                        }
                    }
                }
                if pending == 0 {
                    return Ok(pass);
                }
                if *budget == 0 {
                    pass.out_of_budget = true;
                    return Ok(pass);
                }
            }
            if got == 0 {
                return Ok(pass);
            }
        }
    }
}

/// Which matches of a pass to keep: the first `n` (reading forwards, it stops there) or the
/// last `n` (reading a backward window).
#[derive(Debug, Clone, Copy)]
enum Keep {
    First(usize),
    Last(usize),
}
