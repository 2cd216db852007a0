//! Settles on the wire: ack, nak, term and in-progress sent on a delivery's reply subject,
//! confirmed by the server (ack-sync), and the unconfirmed nak that releases an unleased
//! delivery.
//!
//! May import: `domain` (the settle vocabulary). Nothing of the gateway above the boundary.

use bytes::Bytes;
use tracing::warn;

use crate::domain::settle::AckCommand;

use super::{API_TIMEOUT, Bound};

/// The payload NATS understands for `command`.
fn payload(command: &AckCommand) -> Bytes {
    match command {
        AckCommand::Ack => Bytes::from_static(b"+ACK"),
        AckCommand::Nak { delay: None } => Bytes::from_static(b"-NAK"),
        AckCommand::Nak { delay: Some(delay) } => {
            Bytes::from(format!("-NAK {{\"delay\": {}}}", delay.as_nanos()))
        }
        AckCommand::Term { reason: None } => Bytes::from_static(b"+TERM"),
        AckCommand::Term {
            reason: Some(reason),
        } => Bytes::from(format!("+TERM {reason}")),
        AckCommand::InProgress => Bytes::from_static(b"+WPI"),
    }
}

/// Why the server did not confirm a settle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ConfirmError {
    /// Not connected, or nobody answers on the ack subject (consumer gone).
    Unavailable,
    /// No confirmation within the timeout; the command may or may not have arrived.
    TimedOut,
}

/// Send `command` on `reply` and wait for the server's confirmation (an ack with a reply
/// subject is answered once the server processed it) until `deadline` resolves.
///
/// The deadline is a future, not a duration, so that the settles of one batch share one
/// timer: async-nats' own request timeout is off here, and a timer per settle would cost a
/// timer-wheel insert and, on a busy runtime, a wake-up of the thread parked on the driver,
/// for every message.
pub(crate) async fn confirm(
    bound: &Bound,
    reply: &str,
    command: &AckCommand,
    deadline: impl Future<Output = ()>,
) -> Result<(), ConfirmError> {
    if !bound.is_connected() {
        return Err(ConfirmError::Unavailable);
    }
    let request = async_nats::Request::new()
        .payload(payload(command))
        .timeout(None);
    tokio::select! {
        // A confirmation that is there wins over a deadline that passed meanwhile.
        biased;
        confirmed = bound.client.send_request(reply.to_owned(), request) => match confirmed {
            Ok(_) => Ok(()),
            Err(err) => match err.kind() {
                async_nats::RequestErrorKind::TimedOut => Err(ConfirmError::TimedOut),
                async_nats::RequestErrorKind::NoResponders => Err(ConfirmError::Unavailable),
                _ => {
                    warn!(error = %err, "settle request failed");
                    Err(ConfirmError::Unavailable)
                }
            },
        },
        () = deadline => Err(ConfirmError::TimedOut),
    }
}

/// Tell the server to redeliver a message the gateway will not lease, without waiting.
pub(crate) async fn release(bound: &Bound, reply: &str) {
    if !send(bound, reply, &AckCommand::Nak { delay: None }).await {
        warn!("could not nak an unleased message; the server redelivers it after ack_wait");
    }
}

/// Restart the ack timer of a message the gateway holds (for its ordering key), without
/// waiting: should it be lost, the server delivers the message again and the newer
/// delivery takes the held one's place.
pub(crate) async fn keep_alive(bound: &Bound, reply: &str) {
    if !send(bound, reply, &AckCommand::InProgress).await {
        warn!("could not keep a held message alive; the server redelivers it after ack_wait");
    }
}

/// Publish `command` on `reply` without asking for a confirmation.
async fn send(bound: &Bound, reply: &str, command: &AckCommand) -> bool {
    // Publishing only queues, but blocks once the queue is full while disconnected.
    let published = tokio::time::timeout(
        API_TIMEOUT,
        bound.client.publish(reply.to_owned(), payload(command)),
    )
    .await;
    matches!(published, Ok(Ok(())))
}
