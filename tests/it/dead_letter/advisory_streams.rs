//! The advisory streams behind dead-lettering: one per stream shared by its consumers, and
//! an earlier release's stream used while it exists.

use std::time::Duration;

use ruststream_nats::dead_letter::headers;

use crate::support::{Msg, STREAM, Setup, wait_until};

use super::inspect::{
    DLQ, advisory_streams, consumer_names, dead_letters, dlq_count, header, stream_count,
};

/// Two dead-lettering consumers of one stream (the default one and one of the consumers
/// file): one advisory stream for the stream, one durable per consumer, and each
/// consumer's terms copied to its own subject, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumers_of_one_stream_share_one_advisory_stream() {
    let (server, js) = crate::support::server_with_stream().await;
    js.create_stream(DLQ, &["DLQ.>"]).await;
    let dir = crate::support::nats::files_dir();
    let file = dir.path().join("consumers.toml");
    std::fs::write(
        &file,
        "[[consumer]]\nstream = \"ORDERS\"\nname = \"shipping\"\ndead_letter_subject = \"DLQ.shipping\"\n",
    )
    .expect("write the consumers file");
    let gateway = Setup::consumer("billing")
        .dead_letter_subject("DLQ.billing")
        .flag("--consumers-file", file.display().to_string())
        .ready(&server.url())
        .await;
    let first = js.publish("orders.1", "bad for billing").await;
    let second = js.publish("orders.1", "bad for shipping").await;
    let billing = gateway.fetch_n(2, 1000).await;
    let shipping = gateway
        .post(
            &format!("/streams/{STREAM}/consumers/shipping/fetch"),
            Some(&serde_json::json!({ "batch": 2, "wait_ms": 1000 })),
        )
        .await
        .messages();
    let by_sequence = |leased: &[Msg], sequence: u64| {
        leased
            .iter()
            .find(|m| m.stream_sequence == sequence)
            .map(|m| m.id.clone())
            .expect("leased")
    };
    assert_eq!(gateway.term(&by_sequence(&billing, first), None).await, 204);
    assert_eq!(
        gateway.term(&by_sequence(&shipping, second), None).await,
        204
    );
    wait_until("both terms are copied", Duration::from_secs(10), || async {
        dlq_count(&js).await == 2
    })
    .await;
    let letters = dead_letters(&js).await;
    assert_eq!(header(&letters[&first], headers::CONSUMER), "billing");
    assert_eq!(letters[&first].subject.as_str(), "DLQ.billing");
    assert_eq!(header(&letters[&second], headers::CONSUMER), "shipping");
    assert_eq!(letters[&second].subject.as_str(), "DLQ.shipping");
    let streams = advisory_streams(&js).await;
    assert_eq!(streams.len(), 1, "{streams:?}");
    assert!(
        streams[0].starts_with("RUSTSTREAM_ADVISORIES_ORDERS_"),
        "{streams:?}"
    );
    assert_eq!(
        consumer_names(&js, &streams[0]).await,
        [
            "ruststream-dead-letters_billing",
            "ruststream-dead-letters_shipping"
        ]
    );
}

/// The advisory stream an earlier release made for one consumer is used as long as it
/// exists; nothing else is made next to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_earlier_releases_advisory_stream_is_used_while_it_exists() {
    let (server, js) = crate::support::server_with_stream().await;
    js.create_stream(DLQ, &["DLQ.>"]).await;
    let legacy = "RUSTSTREAM_ADVISORIES_ORDERS_billing";
    js.create_stream(
        legacy,
        &[
            "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.ORDERS.billing",
            "$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.ORDERS.billing",
        ],
    )
    .await;
    let gateway = Setup::consumer("billing")
        .dead_letter_subject("DLQ.billing")
        .ready(&server.url())
        .await;
    js.publish("orders.1", "bad").await;
    let leased = gateway.fetch_n(1, 1000).await;
    assert_eq!(gateway.term(&leased[0].id, None).await, 204);
    wait_until("the term is copied", Duration::from_secs(10), || async {
        dlq_count(&js).await == 1
    })
    .await;
    assert_eq!(stream_count(&js, legacy).await, Some(1));
    assert_eq!(advisory_streams(&js).await, [legacy]);
    assert_eq!(
        consumer_names(&js, legacy).await,
        ["ruststream-dead-letters"]
    );
}
