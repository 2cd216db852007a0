//! The consumer's settled records (see [`crate::nats::settled`]), from this side: every
//! confirmed ack or term is recorded before it is answered 2xx, and the records of every
//! gateway on the consumer are read back when it binds and followed live, so that none of
//! them hands such a message out again.
//!
//! Writing: a settle's record is sent alongside the settle, and the 2xx waits for both; a
//! settle that then goes unconfirmed has its record voided by a later one. Settles arriving
//! together (a batch settle; single settles queued while the writer was busy) go out as one
//! record, up to 4 records of a consumer in flight at once — a lone settle waits for no
//! timer, nor for the records before it.
//!
//! Reading: one reader per consumer from its first binding on; before a binding serves (and
//! after every reconnect) the supervisor waits until the reader has read every record
//! stored by then — until then nothing is leased.
//!
//! May import: as the rest of `gateway`.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use futures::stream::FuturesUnordered;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::{Notify, mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::compactor::{self, Compactor};
use crate::domain::finals::MessageKey;
use crate::error::Error;
use crate::nats::Bound;
use crate::nats::settled::{MAX_PER_RECORD, Records, Settled};
use crate::state::LeaseState;

/// How long a record may take to be stored before the settle waiting for it is answered
/// 503 (it is also bounded by the settle's own deadline).
const STORE_TIMEOUT: Duration = Duration::from_secs(5);
/// Records of one consumer being stored at once. Each record costs the server about as much
/// whatever it carries, so settles that come while these are on their way wait and share the
/// next one; as the record goes out alongside the ack, that wait is mostly hidden behind it
/// (1, 4 and 16 measured alike on the drains, within their noise; 4 writes a third fewer
/// records than 16 under pushes of one message).
const RECORDS_IN_FLIGHT: usize = 4;
/// Longest wait before a reader that failed is opened again.
const REOPEN_AT_MOST: Duration = Duration::from_secs(2);

/// What one settle asks the records to say.
enum Entry {
    /// The message ended.
    Ended(Settled),
    /// The settle recorded as ended went unconfirmed after all.
    Voided(MessageKey),
}

/// One entry waiting to be stored.
struct Waiting {
    entry: Entry,
    stored: oneshot::Sender<Result<(), String>>,
}

/// Writes the consumer's records. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Recorder {
    queue: mpsc::UnboundedSender<Waiting>,
    /// Entries not yet stored or refused (a shutdown's grace waits for them).
    pending: Arc<AtomicUsize>,
    /// Wakes [`Recorder::idle`] when `pending` drops to 0.
    drained: Arc<Notify>,
}

impl Recorder {
    /// A recorder writing to the records the binding in force names (none: nothing is
    /// written, and every settle goes through as before).
    pub(super) fn start(
        binding: watch::Receiver<Option<Arc<Bound>>>,
        stop: CancellationToken,
    ) -> Self {
        let (queue, waiting) = mpsc::unbounded_channel();
        let recorder = Self {
            queue,
            pending: Arc::default(),
            drained: Arc::default(),
        };
        let writer = recorder.clone();
        tokio::spawn(async move {
            tokio::select! {
                () = writer.write(waiting, binding) => {}
                () = stop.cancelled() => {}
            }
        });
        recorder
    }

    /// Resolves once no entry waits to be stored.
    pub(super) async fn idle(&self) {
        loop {
            let drained = self.drained.notified();
            tokio::pin!(drained);
            // Registered before looking, so a drain in between is not missed.
            drained.as_mut().enable();
            if self.pending.load(Ordering::Acquire) == 0 {
                return;
            }
            drained.await;
        }
    }

    fn done(&self, count: usize) {
        if self.pending.fetch_sub(count, Ordering::AcqRel) == count {
            self.drained.notify_waiters();
        }
    }

    /// Count an entry about to be asked for as pending from now: taken before the lease
    /// it follows is finished, so that a shutdown's grace, which ends when no lease is in
    /// flight, cannot end between the two.
    pub(super) fn reserve(&self) -> Reservation {
        self.pending.fetch_add(1, Ordering::AcqRel);
        Reservation(Some(self.clone()))
    }

    /// Record that `settled`'s message ended, its settle already confirmed; `Ok` once the
    /// record is stored (or there is no records stream). 503 when it is not stored by
    /// `deadline`, or cannot be.
    pub(super) async fn record(
        &self,
        settled: Settled,
        deadline: impl Future<Output = ()>,
    ) -> Result<(), Error> {
        self.reserve()
            .recording(settled)
            .map_err(not_recorded)?
            .stored(deadline)
            .await
    }

    /// Record that `settled`'s message ended, without waiting: for an ending nobody is
    /// answered for (a push the endpoint took whose ack did not land).
    pub(crate) fn record_later(&self, settled: Settled) {
        let _ = self.reserve().send(Entry::Ended(settled));
    }
}

/// An entry counted as pending, not yet asked for (see [`Recorder::reserve`]); dropped
/// unused, it is uncounted.
pub(super) struct Reservation(Option<Recorder>);

impl Drop for Reservation {
    fn drop(&mut self) {
        if let Some(recorder) = self.0.take() {
            recorder.done(1);
        }
    }
}

impl Reservation {
    /// Queue the reserved entry; the receiver hears whether it was stored. `Err`: why it
    /// could not be queued.
    fn send(mut self, entry: Entry) -> Result<(Recorder, RecordAnswer), &'static str> {
        let Some(recorder) = self.0.take() else {
            return Err("the record was already asked for");
        };
        let (stored, answer) = oneshot::channel();
        if recorder.queue.send(Waiting { entry, stored }).is_err() {
            recorder.done(1);
            return Err("the consumer is stopping");
        }
        Ok((recorder, answer))
    }

    /// Send the record that `settled`'s message ended now, alongside the settle it records,
    /// so that the two round trips overlap. The settle's outcome decides what becomes of it
    /// (see [`Recording`]).
    /// 503 when it cannot be sent; then neither is the settle.
    pub(super) fn start(self, settled: Settled) -> Result<Recording, Error> {
        self.recording(settled).map_err(|why| {
            Error::Unavailable(format!(
                "the settle was not sent: its record, which keeps every gateway from handing the message out again, cannot be ({why}); retry: the same id settles"
            ))
        })
    }

    /// Queue the record that `settled`'s message ended; `Err`: why it could not be.
    fn recording(self, settled: Settled) -> Result<Recording, &'static str> {
        let message = settled.0;
        let (recorder, answer) = self.send(Entry::Ended(settled))?;
        Ok(Recording {
            recorder,
            message,
            answer: Some(answer),
        })
    }
}

type RecordAnswer = oneshot::Receiver<Result<(), String>>;

/// A record sent before its settle was confirmed. [`Recording::stored`] once it is;
/// dropped instead (the settle failed, timed out or was abandoned), it is voided by a later
/// record, so that no gateway takes the message as ended on a settle answered non-2xx.
pub(super) struct Recording {
    recorder: Recorder,
    message: MessageKey,
    /// `None` once the settle was confirmed.
    answer: Option<RecordAnswer>,
}

impl Recording {
    /// The settle was confirmed: `Ok` once its record is stored, 503 when it is not by
    /// `deadline`, or cannot be.
    pub(super) async fn stored(mut self, deadline: impl Future<Output = ()>) -> Result<(), Error> {
        let Some(answer) = self.answer.take() else {
            return Err(not_recorded("the record was already asked for"));
        };
        tokio::select! {
            biased;
            answer = answer => match answer {
                Ok(Ok(())) => Ok(()),
                Ok(Err(why)) => Err(not_recorded(&why)),
                Err(_) => Err(not_recorded("the consumer is stopping")),
            },
            () = deadline => Err(not_recorded("it was not stored in time")),
        }
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        let Some(answer) = self.answer.take() else {
            return;
        };
        // After the record's own answer, stored or not (a store that timed out may still
        // have landed), so that the void is stored after what it voids.
        let void = self.recorder.reserve();
        let message = self.message;
        tokio::spawn(async move {
            let _ = answer.await;
            let _ = void.send(Entry::Voided(message));
        });
    }
}

fn not_recorded(why: &str) -> Error {
    Error::Unavailable(format!(
        "the server confirmed the settle, but its record, which keeps every gateway from handing the message out again, is not stored ({why}); retry: the same id settles again"
    ))
}

impl Recorder {
    /// Store what waits, a record at a time, each with everything that came meanwhile.
    async fn write(
        &self,
        mut waiting: mpsc::UnboundedReceiver<Waiting>,
        binding: watch::Receiver<Option<Arc<Bound>>>,
    ) {
        // Records are stored concurrently, a few at a time: a settle waits for its own
        // record's round trip, not for the ones before it as well.
        let mut storing = FuturesUnordered::new();
        loop {
            tokio::select! {
                next = waiting.recv(), if storing.len() < RECORDS_IN_FLIGHT => {
                    let Some(first) = next else { break };
                    let mut batch = vec![first];
                    while batch.len() < MAX_PER_RECORD {
                        match waiting.try_recv() {
                            Ok(next) => batch.push(next),
                            Err(_) => break,
                        }
                    }
                    let records = binding
                        .borrow()
                        .as_ref()
                        .and_then(|bound| bound.settled_records.clone());
                    storing.push(store(records, batch));
                }
                Some(count) = storing.next(), if !storing.is_empty() => self.done(count),
            }
        }
        while let Some(count) = storing.next().await {
            self.done(count);
        }
    }
}

/// The first pause before reading a floor record again whose seek mark could not be read.
const MARK_BACKOFF_FIRST: Duration = Duration::from_millis(50);

/// Store one record of `batch` and answer each of its entries; how many it answered.
async fn store(records: Option<Arc<Records>>, batch: Vec<Waiting>) -> usize {
    let count = batch.len();
    // Taken apart once, with no copy of any settle (a term's reason is a string).
    let mut ended = Vec::with_capacity(count);
    let mut voided = Vec::new();
    let mut answers = Vec::with_capacity(count);
    for Waiting { entry, stored } in batch {
        match entry {
            Entry::Ended(settled) => ended.push(settled),
            Entry::Voided(message) => voided.push(message),
        }
        answers.push(stored);
    }
    let result = match records {
        // No records stream (refused by the server; an ephemeral consumer): only this
        // process remembers, as the consumer's durability says.
        None => Ok(()),
        Some(records) => records
            .store(&ended, &voided, STORE_TIMEOUT)
            .await
            .map_err(|err| format!("{err:#}")),
    };
    if let Err(why) = &result {
        warn!(settles = count, reason = %why, "could not store a settled record; those settles are answered 503");
    }
    for stored in answers {
        let _ = stored.send(result.clone());
    }
    count
}

/// The reader of the consumer's records: how far it has read, and the floor below which it
/// keeps nothing. Both carry a generation, bumped when the floor goes down and everything is
/// read again.
pub(super) struct Reader {
    /// The generation, and the records stream's sequence of the last record read in it (0:
    /// none yet).
    read: watch::Receiver<(u64, u64)>,
    /// The floor, and the generation.
    floor: watch::Sender<(u64, u64)>,
}

impl Reader {
    /// Read `records` into `state` from the start, then follow them, until `stop`; drop
    /// those under the consumer's ack floor (see [`Compactor`]).
    pub(super) fn start(
        records: Arc<Records>,
        state: Arc<LeaseState>,
        floor: u64,
        stop: CancellationToken,
    ) -> Self {
        let (read_tx, read) = watch::channel((0, 0));
        let (floor, floor_rx) = watch::channel((floor, 0));
        let compactor = Arc::new(Compactor::new());
        tokio::spawn(compactor::keep_bounded(
            Arc::clone(&compactor),
            Arc::clone(&records),
            Arc::clone(&state),
            read.clone(),
            stop.clone(),
        ));
        tokio::spawn(async move {
            tokio::select! {
                () = follow(records, state, read_tx, floor_rx, &compactor) => {}
                () = stop.cancelled() => {}
            }
        });
        Self { read, floor }
    }

    /// Wait until every record stored before this call is read, with `floor` the
    /// consumer's ack floor now (lower than before: the server forgot settles, and the
    /// records are read again from the start). An error when that takes longer than
    /// `timeout` or the records cannot be looked at.
    pub(super) async fn catch_up(
        &mut self,
        records: &Records,
        floor: u64,
        timeout: Duration,
    ) -> anyhow::Result<()> {
        let (before, generation) = *self.floor.borrow();
        let generation = if floor < before {
            generation + 1
        } else {
            generation
        };
        self.floor.send_replace((floor, generation));
        let last = records.last_sequence().await?;
        let caught_up = self
            .read
            .wait_for(|(read_in, read)| *read_in == generation && *read >= last);
        let waited = tokio::time::timeout(timeout, caught_up)
            .await
            .map(|caught_up| caught_up.map(drop));
        match waited {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => anyhow::bail!("the reader of the settled records stopped"),
            Err(_) => anyhow::bail!(
                "the settled records were not all read within {timeout:?} (read to {}, stored to {last})",
                self.read.borrow().1
            ),
        }
    }
}

/// Read the records into `state`, reopening the reader after an error where it stopped, and
/// from the start when the floor goes down; and keep them bounded (see [`Compactor`]).
async fn follow(
    records: Arc<Records>,
    state: Arc<LeaseState>,
    read: watch::Sender<(u64, u64)>,
    mut floor: watch::Receiver<(u64, u64)>,
    compactor: &Compactor,
) {
    let (mut loaded_above, mut generation) = *floor.borrow_and_update();
    let mut backoff = Duration::from_millis(50);
    // Its own: a reader reopened at a floor record whose mark could not be read is open
    // again at once, which resets the other.
    let mut mark_backoff = MARK_BACKOFF_FIRST;
    loop {
        let from = read.borrow().1 + 1;
        let mut reader = match records.read_from(from).await {
            Ok(reader) => Box::pin(reader),
            Err(err) => {
                debug!(error = %format!("{err:#}"), retry_in = ?backoff, "cannot read the settled records yet");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(REOPEN_AT_MOST);
                continue;
            }
        };
        backoff = Duration::from_millis(50);
        loop {
            tokio::select! {
                changed = floor.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    // A catch-up: the connection came back, maybe to a server restarted
                    // that forgot what was not on disk.
                    compactor.reconnected();
                    let (now, now_generation) = *floor.borrow_and_update();
                    loaded_above = now;
                    if now_generation != generation {
                        // What was skipped as below the floor may be delivered again.
                        generation = now_generation;
                        compactor.read_again();
                        read.send_replace((generation, 0));
                        break;
                    }
                }
                next = reader.next() => match next {
                    Some(Ok((sequence, opened))) => {
                        let floor = match opened.floor {
                            Some(floor) => match records.floor_believed(opened.floor_mark.as_deref()).await {
                                Ok(true) => {
                                    mark_backoff = MARK_BACKOFF_FIRST;
                                    Some(floor)
                                }
                                Ok(false) => {
                                    mark_backoff = MARK_BACKOFF_FIRST;
                                    debug!(sequence, written_under = ?opened.floor_mark, "a floor record written across a move at another replica is not believed");
                                    None
                                }
                                Err(err) => {
                                    // Not read yet: the reader reopens at this record.
                                    debug!(error = %format!("{err:#}"), retry_in = ?mark_backoff, "cannot check a floor record's seek mark; reading again from it");
                                    tokio::time::sleep(mark_backoff).await;
                                    mark_backoff = (mark_backoff * 2).min(REOPEN_AT_MOST);
                                    break;
                                }
                            },
                            None => None,
                        };
                        // A floor not believed names nothing: the record may be dropped at once.
                        let max_sequence = if opened.floor.is_some() && floor.is_none() {
                            0
                        } else {
                            opened.max_sequence
                        };
                        compactor.read(
                            sequence,
                            max_sequence,
                            floor.map(|floor| floor.stream_sequence),
                        );
                        if let Some(floor) = floor {
                            state.raise_fleet_floor(floor);
                        }
                        if !opened.ended.is_empty() || !opened.voided.is_empty() {
                            state.ended_in_fleet(opened.ended, &opened.voided, loaded_above);
                        }
                        read.send_replace((generation, sequence));
                    }
                    Some(Err(err)) => {
                        debug!(error = %format!("{err:#}"), "reading the settled records failed; reopening");
                        break;
                    }
                    None => break,
                },
            }
        }
    }
}
