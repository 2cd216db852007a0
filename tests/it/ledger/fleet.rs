//! The gateway replicas a run talks to, the ledger's HTTP client, and what counts as a live
//! lease refused by its owner.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::support::Client;
use crate::support::client::http_builder;

use super::book::{Lease, SharedLedger, lock};

/// The ledger's client: a shorter bound than the suite's, so a worker caught by a fault
/// moves on.
pub(super) fn client(base: &str) -> Client {
    let http = http_builder()
        .timeout(Duration::from_secs(15))
        .build()
        .expect("reqwest client");
    Client::with_http(base, http)
}

/// The replicas a run talks to: one in the sticky runs, three in the non-sticky ones, where
/// each fetch goes to a random replica and each settle to another one than the fetch.
pub(super) struct Fleet {
    pub(super) clients: Vec<Client>,
    /// Bumped when a replica is killed or has stopped (its leases may be refused from then
    /// on), and for all of them when a nats-server is killed (a new lease epoch may follow).
    generations: Vec<AtomicU64>,
    /// Bumped when a replica's process is replaced (killed or stopped, then started again):
    /// which process issued a lease and confirmed a settle.
    lives: Vec<AtomicU64>,
    /// Replicas out of the rotation, as a balancer's readiness check takes them out: in the
    /// roll, from the old process' exit until its successor is ready (a replica answers
    /// HTTP before its NATS connection is up, and its settles 503 until then).
    out: Vec<std::sync::atomic::AtomicBool>,
}

impl Fleet {
    pub(super) fn new(bases: &[String]) -> Arc<Self> {
        Arc::new(Self {
            clients: bases.iter().map(|base| client(base)).collect(),
            generations: bases.iter().map(|_| AtomicU64::new(0)).collect(),
            lives: bases.iter().map(|_| AtomicU64::new(0)).collect(),
            out: bases
                .iter()
                .map(|_| std::sync::atomic::AtomicBool::new(false))
                .collect(),
        })
    }

    pub(super) fn life(&self, replica: usize) -> u64 {
        self.lives[replica].load(Ordering::SeqCst)
    }

    /// Replica `replica`'s process is gone; the next one is another life.
    pub(super) fn replaced(&self, replica: usize) {
        self.lives[replica].fetch_add(1, Ordering::SeqCst);
    }

    /// A random replica for a fetch.
    pub(super) fn pick(&self) -> usize {
        let count = self.clients.len();
        let first = rand::random_range(0..count);
        (0..count)
            .map(|step| (first + step) % count)
            .find(|replica| !self.is_out(*replica))
            .unwrap_or(first)
    }

    /// The client for a settle of `lease`: another replica than the one that issued it,
    /// when there are several (one in the rotation, when there is one).
    pub(super) fn settler(&self, lease: &Lease) -> &Client {
        let count = self.clients.len();
        if count == 1 {
            return &self.clients[0];
        }
        let first = rand::random_range(1..count);
        let other = (0..count - 1)
            .map(|step| (lease.owner + 1 + (first - 1 + step) % (count - 1)) % count)
            .find(|replica| !self.is_out(*replica))
            .unwrap_or((lease.owner + first) % count);
        &self.clients[other]
    }

    fn is_out(&self, replica: usize) -> bool {
        self.out[replica].load(Ordering::SeqCst)
    }

    /// Take `replica` out of the rotation, or put it back.
    pub(super) fn set_out(&self, replica: usize, out: bool) {
        self.out[replica].store(out, Ordering::SeqCst);
    }

    pub(super) fn generation(&self, replica: usize) -> u64 {
        self.generations[replica].load(Ordering::SeqCst)
    }

    pub(super) fn bump(&self, replica: usize) {
        self.generations[replica].fetch_add(1, Ordering::SeqCst);
    }

    pub(super) fn bump_all(&self) {
        for replica in 0..self.generations.len() {
            self.bump(replica);
        }
    }

    /// A settle of `lease` answered `status`, just now: a 404 or 410 answered while the lease
    /// was still live (the owner decided before its expiry) by an owner alive since the
    /// fetch breaks the contract.
    /// `detail`: the problem's, when the answer was one.
    pub(super) fn check_refusal(
        &self,
        ledger: &SharedLedger,
        lease: &Lease,
        status: u16,
        detail: &str,
    ) {
        let answered_at = time::OffsetDateTime::now_utc();
        let live = lease
            .expires_at
            .is_some_and(|expires_at| answered_at < expires_at);
        if matches!(status, 404 | 410) && live && self.generation(lease.owner) == lease.generation {
            lock(ledger).refused_live.push(format!(
                "{} (delivery {}, issued by replica {}): {status} {}",
                lease.ledger_id,
                lease.delivered,
                lease.owner,
                detail.chars().take(200).collect::<String>()
            ));
        }
        // Whatever the servers did meanwhile, an owner still running is never taken for
        // gone while its lease lives (a missing heartbeat must not outweigh its answer).
        if status == 410
            && live
            && detail.contains(OWNER_GONE)
            && self.life(lease.owner) == lease.life
        {
            lock(ledger).refused_live.push(format!(
                "{} (delivery {}, issued by replica {}, still running): 410 owner gone",
                lease.ledger_id, lease.delivered, lease.owner
            ));
        }
    }
}

/// The name of the server leading the consumer.
/// What a 410 says when the replica that issued the lease was taken for gone.
const OWNER_GONE: &str = "the replica that issued it is gone";
