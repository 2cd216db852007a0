//! What every push test shares: the push consumer's name and consumers-file entry, the
//! payload and delivery count of a push, and the consumer's view.

use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use serde_json::Value;

use crate::support::endpoint::Received;
use crate::support::{Client, STREAM, wait_until};

/// The push consumer every test declares.
pub(super) const PUSHED: &str = "hooks";

/// A consumers-file entry for the push consumer `name`, delivering to `url`, with `extra`
/// lines of its push table.
pub(super) fn entry(name: &str, url: &str, extra: &str) -> String {
    format!(
        "[[consumer]]\nstream = \"{STREAM}\"\nname = \"{name}\"\nack_wait = \"20s\"\n\n[consumer.push]\nurl = \"{url}\"\nretry_initial = \"100ms\"\nretry_max = \"200ms\"\n{extra}\n"
    )
}

/// The payload of a json-format push.
pub(super) fn payload(received: &Received) -> String {
    let data = received.json()["data"].as_str().expect("data").to_owned();
    String::from_utf8(STANDARD.decode(data).expect("base64 data")).expect("UTF-8 payload")
}

pub(super) fn delivered(received: &Received) -> u64 {
    received
        .header("ruststream-delivered")
        .expect("Ruststream-Delivered")
        .parse()
        .expect("a number")
}

pub(super) async fn push_view(gateway: &Client) -> Value {
    let reply = gateway
        .get(&format!("/streams/{STREAM}/consumers/{PUSHED}"))
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    reply.body
}

/// Wait until the server has every message of the push consumer acked or terminated.
pub(super) async fn wait_all_settled(gateway: &Client) {
    wait_until(
        "every pushed message settled",
        Duration::from_secs(15),
        || async {
            let view = push_view(gateway).await;
            view["num_ack_pending"] == 0 && view["num_pending"] == 0
        },
    )
    .await;
}
