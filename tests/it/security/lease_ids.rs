//! Lease ids under attack and across restarts: a tampered or truncated id is a 404 that never
//! reaches NATS; `--lease-key-file` makes a restarted gateway know its predecessor's ids.

use std::io::Write as _;
use std::time::Duration;

use futures::StreamExt as _;
use serde_json::json;

use crate::support::{Action, NatsServer, Setup};

fn key_file(text: &str) -> tempfile::NamedTempFile {
    let mut file = tempfile::NamedTempFile::new().expect("temp file");
    file.write_all(text.as_bytes()).expect("write key");
    file
}

/// Variants of a genuine id that a client could send: every one must answer 404.
fn forgeries(id: &str) -> Vec<String> {
    let mut forged = vec![
        id[..id.len() - 1].to_owned(),
        format!("{id}A"),
        id[1..].to_owned(),
        "A".repeat(id.len()),
        format!("{}%2e%2e", &id[..id.len() - 6]),
        "..".to_owned(),
        "$JS.ACK.ORDERS.x.1.1.1.1.0".to_owned(),
    ];
    // Flip one character at the start, in the body, and in the tag.
    for at in [0, 3, id.len() / 2, id.len() - 2, id.len() - 1] {
        let mut bytes = id.as_bytes().to_vec();
        bytes[at] = if bytes[at] == b'B' { b'C' } else { b'B' };
        forged.push(String::from_utf8(bytes).expect("ascii"));
    }
    forged
}

#[tokio::test]
async fn tampered_ids_answer_404_and_send_nothing_to_nats() {
    let (_server, js, gateway) = Setup::consumer("tamper").start().await;
    js.publish_many("orders.tamper", 2, "t").await;
    let mut acks = js.client.subscribe("$JS.ACK.>").await.expect("subscribe");
    js.client.flush().await.expect("flush");
    let leased = gateway.fetch_n(2, 5000).await;
    assert_eq!(leased.len(), 2);
    let (victim, witness) = (&leased[0], &leased[1]);

    for forged in forgeries(&victim.id) {
        for action in Action::ALL {
            let reply = gateway.settle(&urlencode(&forged), action, None).await;
            reply.assert_problem(404);
        }
    }
    let batch = gateway
        .settle_many_ok(Action::Ack, &json!({ "ids": forgeries(&victim.id) }))
        .await;
    assert!(batch.iter().all(|(_, status)| *status == 404), "{batch:?}");

    // One genuine ack after all that: NATS keeps a connection's messages in order, so once
    // the subscriber sees it, it would have seen anything the forgeries had sent before.
    assert_eq!(gateway.ack(&witness.id).await, 204);
    let first = tokio::time::timeout(Duration::from_secs(5), acks.next())
        .await
        .expect("the genuine ack reaches $JS.ACK")
        .expect("subscription open");
    let sequence = |subject: &str| subject.split('.').nth(5).map(str::to_owned);
    assert_eq!(
        sequence(first.subject.as_str()),
        Some(witness.stream_sequence.to_string()),
        "the first ack on the wire must be the genuine one, got {}",
        first.subject
    );
    // And the forged lease is untouched: still valid, settles normally.
    assert_eq!(gateway.ack(&victim.id).await, 204);
}

fn urlencode(id: &str) -> String {
    id.replace('$', "%24")
}

#[tokio::test]
async fn a_restart_with_the_same_key_file_knows_its_predecessors_ids() {
    let (server, js) = crate::support::server_with_stream().await;
    js.publish("orders.restart", "one").await;
    let key = key_file(&format!("{}\n", "5e".repeat(32)));
    let other_key = key_file(&"ab".repeat(32));
    let setup = Setup::consumer("keyed")
        .shutdown_grace("0s")
        .lease_key_file(key.path());

    let mut first = setup.ready(&server.url()).await;
    let leased = first.fetch_n(1, 5000).await;
    let id = leased[0].id.clone();
    first.shutdown().await.expect("clean stop");

    // Same key: genuine but not this process's lease (its settle state and reply subject
    // died with the predecessor) — 410 for every action, never 404, never 5xx.
    let second = setup.ready(&server.url()).await;
    for action in Action::ALL {
        second.settle(&id, action, None).await.assert_problem(410);
    }
    drop(second);

    // Another key: the id is not ours at all.
    let third = Setup::consumer("keyed")
        .lease_key_file(other_key.path())
        .ready(&server.url())
        .await;
    third
        .settle(&id, Action::Ack, None)
        .await
        .assert_problem(404);
}

#[tokio::test]
async fn a_short_or_missing_key_file_refuses_to_start_without_showing_the_key() {
    let server = NatsServer::start().await;
    let short = key_file("too-short-secret\n");
    for (path, expect) in [
        (short.path().to_str().expect("utf8"), "at least 32 bytes"),
        ("/nonexistent/lease.key", "/nonexistent/lease.key"),
    ] {
        let mut gateway = Setup::consumer("k")
            .flag("--lease-key-file", path)
            .starting(&server.url())
            .await;
        let err = format!("{:#}", gateway.exit_result().await.expect_err("refused"));
        assert!(err.contains(expect), "{err}");
        assert!(
            !err.contains("too-short-secret"),
            "the error shows the key: {err}"
        );
    }
}
