//! The dead letters of what this gateway serves, read across every dead-letter stream: the
//! streams capturing `--dead-letter-subject` and each served consumer's
//! `dead_letter_subject`, in name order. A dead letter's id and a listing's cursor name the
//! stream and a sequence in it; both are opaque to clients.
//!
//! May import: as the rest of `gateway`.

use std::fmt;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

use crate::error::Error;
use crate::nats::dead_letter_reader::{self, DeadLetter, Filter, Order, SCAN_BUDGET};

use super::Gateway;

/// A dead letter's id: `<dead-letter stream>:<sequence>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DeadLetterId {
    pub(crate) store: String,
    pub(crate) sequence: u64,
}

impl fmt::Display for DeadLetterId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.store, self.sequence)
    }
}

impl DeadLetterId {
    pub(crate) fn of(letter: &DeadLetter) -> Self {
        Self {
            store: letter.store.clone(),
            sequence: letter.sequence,
        }
    }

    /// The id `text` spells; `None` when it spells none. (A stream name may hold a colon;
    /// the sequence after the last one never does.)
    pub(crate) fn parse(text: &str) -> Option<Self> {
        let (store, sequence) = text.rsplit_once(':')?;
        let sequence = sequence.parse().ok().filter(|sequence| *sequence > 0)?;
        (!store.is_empty()).then(|| Self {
            store: store.to_owned(),
            sequence,
        })
    }
}

/// Where a listing goes on: the order it was read in, the stream, and the sequence in it
/// (oldest first: the next to read; newest first: the one read below).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Cursor {
    order: Order,
    store: String,
    sequence: u64,
}

impl Cursor {
    pub(crate) fn encode(&self) -> String {
        let order = match self.order {
            Order::NewestFirst => 'n',
            Order::OldestFirst => 'o',
        };
        URL_SAFE_NO_PAD.encode(format!("{order}:{}:{}", self.sequence, self.store))
    }

    pub(crate) fn decode(text: &str) -> Option<Self> {
        let bytes = URL_SAFE_NO_PAD.decode(text).ok()?;
        let text = String::from_utf8(bytes).ok()?;
        let mut parts = text.splitn(3, ':');
        let order = match parts.next()? {
            "n" => Order::NewestFirst,
            "o" => Order::OldestFirst,
            _ => return None,
        };
        let sequence = parts.next()?.parse().ok()?;
        let store = parts.next().filter(|store| !store.is_empty())?.to_owned();
        Some(Self {
            order,
            store,
            sequence,
        })
    }
}

/// What a listing asks for.
#[derive(Debug, Clone)]
pub(crate) struct Listing {
    pub(crate) order: Order,
    pub(crate) filter: Filter,
    pub(crate) limit: usize,
    pub(crate) cursor: Option<Cursor>,
}

/// A page of dead letters and where the next begins (`None`: nothing further matches).
#[derive(Debug)]
pub(crate) struct DeadLetterPage {
    pub(crate) letters: Vec<DeadLetter>,
    pub(crate) next: Option<Cursor>,
}

impl Gateway {
    /// The subjects dead letters are copied to: the process's and every served consumer's.
    fn dead_letter_subjects(&self) -> Vec<String> {
        let mut subjects: Vec<String> = self.config().dead_letter_subject.iter().cloned().collect();
        for (_, served) in self.0.registry.all() {
            if let Some(subject) = &served.consumer.config().dead_letter_subject {
                subjects.push(subject.clone());
            }
        }
        subjects.sort();
        subjects.dedup();
        subjects
    }

    pub(super) fn jetstream(&self) -> Result<async_nats::jetstream::Context, Error> {
        let client = self
            .0
            .process
            .connection
            .get()
            .ok_or_else(|| Error::Unavailable("not connected to NATS".into()))?;
        Ok(async_nats::jetstream::new(client))
    }

    /// The streams the dead letters are stored in, by name.
    pub(crate) async fn dead_letter_stores(&self) -> Result<Vec<String>, Error> {
        let js = self.jetstream()?;
        let subjects = self.dead_letter_subjects();
        dead_letter_reader::stores(&js, subjects.iter().map(String::as_str))
            .await
            .map_err(unavailable)
    }

    /// One page of the dead letters `listing` asks for.
    pub(crate) async fn dead_letters(&self, listing: Listing) -> Result<DeadLetterPage, Error> {
        if let Some(cursor) = &listing.cursor
            && cursor.order != listing.order
        {
            return Err(Error::invalid(
                "cursor",
                "cursor: it was made for the other order; list again without it",
            ));
        }
        let js = self.jetstream()?;
        let stores = self.dead_letter_stores().await?;
        let (skip, mut from) = match &listing.cursor {
            None => (0, None),
            Some(cursor) => {
                let at = stores.partition_point(|store| *store < cursor.store);
                let same = stores.get(at) == Some(&cursor.store);
                (at, same.then_some(cursor.sequence))
            }
        };
        let mut budget = SCAN_BUDGET;
        let mut letters = Vec::new();
        let mut rest = stores.iter().skip(skip).peekable();
        while let Some(store) = rest.next() {
            let wanted = listing.limit - letters.len();
            let page = dead_letter_reader::page(
                &js,
                store,
                listing.order,
                from.take(),
                &listing.filter,
                wanted,
                &mut budget,
            )
            .await
            .map_err(unavailable)?;
            letters.extend(page.letters);
            let next = match page.next {
                Some(sequence) => Some((store, sequence)),
                None if letters.len() >= listing.limit || budget == 0 => {
                    // This stream is done; the next page starts at the next one's end.
                    rest.peek().map(|store| (*store, start_of(listing.order)))
                }
                None => continue,
            };
            return Ok(DeadLetterPage {
                letters,
                next: next.map(|(store, sequence)| Cursor {
                    order: listing.order,
                    store: store.clone(),
                    sequence,
                }),
            });
        }
        Ok(DeadLetterPage {
            letters,
            next: None,
        })
    }

    /// The dead letter `id` names, if it is in a dead-letter stream of this gateway.
    pub(crate) async fn dead_letter(&self, id: &DeadLetterId) -> Result<DeadLetter, Error> {
        let not_found = || Error::NotFound(format!("no dead letter {id}"));
        let stores = self.dead_letter_stores().await?;
        if !stores.contains(&id.store) {
            return Err(not_found());
        }
        let js = self.jetstream()?;
        dead_letter_reader::get(&js, &id.store, id.sequence)
            .await
            .map_err(unavailable)?
            .ok_or_else(not_found)
    }
}

/// The sequence a cursor names for a stream not read yet.
fn start_of(order: Order) -> u64 {
    match order {
        Order::OldestFirst => 0,
        Order::NewestFirst => u64::MAX,
    }
}

fn unavailable(err: anyhow::Error) -> Error {
    Error::Unavailable(format!("{err:#}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_cursors_read_back() {
        let id = DeadLetterId {
            store: "DLQ:v2".into(),
            sequence: 42,
        };
        assert_eq!(id.to_string(), "DLQ:v2:42");
        assert_eq!(DeadLetterId::parse("DLQ:v2:42"), Some(id));
        for bad in ["DLQ", ":4", "DLQ:0", "DLQ:x", "DLQ:-1"] {
            assert_eq!(DeadLetterId::parse(bad), None, "{bad}");
        }
        let cursor = Cursor {
            order: Order::OldestFirst,
            store: "DLQ:v2".into(),
            sequence: 7,
        };
        assert_eq!(Cursor::decode(&cursor.encode()), Some(cursor));
        assert_eq!(Cursor::decode("not a cursor"), None);
        assert_eq!(Cursor::decode(&URL_SAFE_NO_PAD.encode("x:1:DLQ")), None);
    }
}
