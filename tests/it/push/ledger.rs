//! The push ledger: the push worker under endpoint, gateway and nats-server faults loses
//! nothing and never pushes a message again once the endpoint took it from that process.

use std::time::Duration;

use tokio::time::Instant;

use crate::support::endpoint::{Endpoint, Reply};
use crate::support::nats::files_dir;
use crate::support::{STREAM, Setup, server_with_stream};

use super::fixtures::{PUSHED, delivered, payload};

/// One request as the faulty endpoint of the push ledger answered it.
#[derive(Debug, Clone)]
struct Attempt {
    word: String,
    /// Which gateway process sent it (the test runs one at a time).
    generation: usize,
    taken: bool,
}

/// How the faulty endpoint answers one attempt: the same for the same message and delivery.
fn roll(word: &str, delivered: u64) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in word.bytes().chain(delivered.to_le_bytes()) {
        hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
    }
    hash % 100
}

/// The push worker under faults, at nats-server's default sync: an endpoint that answers
/// 204, 500, 429 or too late at random and is stopped and started again, the gateway killed
/// -9 and restarted, nats-server killed -9 and restarted. Every message ends taken (2xx) or
/// dead-lettered, and no process pushes a message again once the endpoint took it from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ledger_push_under_faults_loses_nothing_and_never_pushes_a_taken_message_again() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    let (mut server, js) = server_with_stream().await;
    js.create_stream("DLQ", &["DLQ.>"]).await;
    let mut endpoint = Endpoint::start().await;
    let generation = Arc::new(AtomicUsize::new(0));
    let attempts: Arc<Mutex<Vec<Attempt>>> = Arc::default();
    {
        let (generation, attempts) = (generation.clone(), attempts.clone());
        endpoint.answer(move |request, _| {
            let word = payload(request);
            let roll = roll(&word, delivered(request));
            let taken = roll < 60;
            attempts.lock().expect("attempts").push(Attempt {
                word,
                generation: generation.load(Ordering::SeqCst),
                taken,
            });
            match roll {
                0..60 => Reply::status(204),
                60..75 => Reply::status(500),
                75..85 => Reply::status(429),
                // Past the push timeout: the gateway never sees this answer.
                _ => Reply::status(500).after(Duration::from_millis(400)),
            }
        });
    }
    let dir = files_dir();
    let path = dir.path().join("consumers.toml");
    std::fs::write(
        &path,
        format!(
            "[[consumer]]\nstream = \"{STREAM}\"\nname = \"{PUSHED}\"\nack_wait = \"5s\"\nmax_deliver = 20\ndead_letter_subject = \"DLQ.hooks\"\n\n[consumer.push]\nurl = \"{}\"\ntimeout = \"250ms\"\nretry_initial = \"50ms\"\nretry_max = \"500ms\"\n",
            endpoint.url
        ),
    )
    .expect("write");
    let setup = Setup::defaults().flag("--consumers-file", path.display().to_string());
    let mut gateway = setup.process(&server.url()).await;
    let mut published = Vec::new();
    let mut publish = |count: usize| {
        let start = published.len();
        published.extend((start..start + count).map(|n| format!("m{n}")));
        published[start..].to_vec()
    };
    let taken_count = |attempts: &Arc<Mutex<Vec<Attempt>>>| {
        let attempts = attempts.lock().expect("attempts");
        attempts
            .iter()
            .filter(|attempt| attempt.taken)
            .map(|attempt| attempt.word.clone())
            .collect::<std::collections::HashSet<_>>()
            .len()
    };
    let wait_taken = |count: usize| {
        let attempts = attempts.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(30);
            while taken_count(&attempts) < count {
                if Instant::now() > deadline {
                    return false;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            true
        }
    };

    for word in publish(60) {
        js.publish("orders.1", word).await;
    }
    assert!(wait_taken(20).await, "{}", gateway.log());
    endpoint.stop();
    tokio::time::sleep(Duration::from_millis(800)).await;
    endpoint.restart().await;
    assert!(wait_taken(40).await, "{}", gateway.log());
    gateway.kill9();
    generation.fetch_add(1, Ordering::SeqCst);
    gateway.restart().await;
    for word in publish(60) {
        js.publish("orders.1", word).await;
    }
    assert!(wait_taken(80).await, "{}", gateway.log());
    server.kill();
    server.restart().await;
    let js = crate::support::Js::connect(&server.url()).await;
    for word in publish(30) {
        js.publish("orders.1", word).await;
    }

    // Each message ends taken or dead-lettered.
    let dead = |js: crate::support::Js| async move {
        let Ok(mut dlq) = js.js.get_stream("DLQ").await else {
            return Vec::new();
        };
        let count = dlq.info().await.map_or(0, |info| info.state.messages);
        let mut words = Vec::new();
        for sequence in 1..=count {
            if let Ok(letter) = dlq.get_raw_message(sequence).await {
                words.push(String::from_utf8_lossy(&letter.payload).into_owned());
            }
        }
        words
    };
    let mut unsettled = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        let taken: std::collections::HashSet<String> = attempts
            .lock()
            .expect("attempts")
            .iter()
            .filter(|attempt| attempt.taken)
            .map(|attempt| attempt.word.clone())
            .collect();
        let dead_lettered: std::collections::HashSet<String> =
            dead(crate::support::Js::connect(&server.url()).await)
                .await
                .into_iter()
                .collect();
        unsettled = published
            .iter()
            .filter(|word| !taken.contains(*word) && !dead_lettered.contains(*word))
            .cloned()
            .collect();
        if unsettled.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        unsettled.is_empty(),
        "lost: {unsettled:?}\n{}",
        gateway.log()
    );

    // No process pushed a message again after the endpoint took it from that process.
    let attempts = attempts.lock().expect("attempts").clone();
    let mut taken_by: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    let mut again = Vec::new();
    for attempt in &attempts {
        if taken_by.get(attempt.word.as_str()) == Some(&attempt.generation) {
            again.push(attempt.word.clone());
        }
        if attempt.taken {
            taken_by.insert(&attempt.word, attempt.generation);
        }
    }
    assert!(
        again.is_empty(),
        "pushed again by the process that got its 2xx: {again:?}"
    );
    let _ = gateway;
}
