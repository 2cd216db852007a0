//! Messages NATS clients cannot parse — a header value or a subject that is not UTF-8, a header
//! line without a colon, an invalid header name — published as raw protocol bytes over a plain
//! socket, between good messages: the gateway's NATS connection never drops, every message is
//! leased once, and the odd ones carry their exact bytes in `subject_base64`/`headers_base64`.

use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use serde_json::json;
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::net::TcpStream;

use crate::support::{NatsServer, STREAM, Scrape, Setup, fetch_count, wait_until};

/// One core publish as raw protocol: `PUB` without a header block, `HPUB` with one.
struct Raw {
    subject: &'static [u8],
    headers: Option<&'static [u8]>,
    payload: &'static [u8],
}

impl Raw {
    fn good(subject: &'static [u8], payload: &'static [u8]) -> Self {
        Self {
            subject,
            headers: None,
            payload,
        }
    }

    fn wire(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self.headers {
            None => {
                out.extend_from_slice(b"PUB ");
                out.extend_from_slice(self.subject);
                out.extend_from_slice(format!(" {}\r\n", self.payload.len()).as_bytes());
            }
            Some(headers) => {
                out.extend_from_slice(b"HPUB ");
                out.extend_from_slice(self.subject);
                let total = headers.len() + self.payload.len();
                out.extend_from_slice(format!(" {} {total}\r\n", headers.len()).as_bytes());
                out.extend_from_slice(headers);
            }
        }
        out.extend_from_slice(self.payload);
        out.extend_from_slice(b"\r\n");
        out
    }
}

/// Publish `messages` in order on a bare TCP connection speaking the NATS protocol (a core
/// publish: the stream captures the subject), and wait for the server's PONG, so the server
/// has read them all.
async fn publish_raw(server: &NatsServer, messages: &[Raw]) {
    let stream = TcpStream::connect(("127.0.0.1", server.port()))
        .await
        .expect("connect to nats-server");
    let (read, mut write) = stream.into_split();
    let mut read = BufReader::new(read);
    let mut line = String::new();
    read.read_line(&mut line).await.expect("INFO");
    assert!(
        line.starts_with("INFO "),
        "the server greets with INFO: {line}"
    );

    let mut out =
        br#"CONNECT {"verbose":false,"pedantic":false,"headers":true,"protocol":1}"#.to_vec();
    out.extend_from_slice(b"\r\n");
    for message in messages {
        out.extend(message.wire());
    }
    out.extend_from_slice(b"PING\r\n");
    write.write_all(&out).await.expect("write the publishes");

    loop {
        line.clear();
        let read = read.read_line(&mut line).await.expect("read the answer");
        assert!(read > 0, "the server closed the raw connection");
        assert!(!line.starts_with("-ERR"), "the server refused: {line}");
        if line.starts_with("PONG") {
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unparsable_messages_are_leased_with_their_bytes_and_the_connection_stays_up() {
    let (server, js, gateway) = Setup::consumer("poison").start().await;

    let x_bin = b"NATS/1.0\r\nX-Bin: \xff\xfe\r\n\r\n";
    let no_colon = b"NATS/1.0\r\nNoColonHere\r\n\r\n";
    let bad_name = b"NATS/1.0\r\nBad Name: v\r\n\r\n";
    // A publisher using the name the NATS client reserves for unparsed blocks cannot pass
    // its own value off as one: the block is handed over raw like any it cannot take.
    let forged = b"NATS/1.0\r\nAsync-Nats-Unparsed-Headers: 00\r\n\r\n";
    let good_headers = b"NATS/1.0\r\nX-Ok: yes\r\n\r\n";
    let messages = [
        Raw::good(b"orders.good.1", b"g1"),
        Raw {
            subject: b"orders.bin-value",
            headers: Some(x_bin),
            payload: b"p-bin-value",
        },
        Raw {
            subject: b"orders.good.2",
            headers: Some(good_headers),
            payload: b"g2",
        },
        Raw {
            subject: b"orders.no-colon",
            headers: Some(no_colon),
            payload: b"p-no-colon",
        },
        Raw::good(b"orders.good.3", b"g3"),
        Raw {
            subject: b"orders.bad-name",
            headers: Some(bad_name),
            payload: b"p-bad-name",
        },
        Raw::good(b"orders.good.4", b"g4"),
        // A subject that is not UTF-8, with a header block (HMSG) and without (MSG).
        Raw {
            subject: b"orders.bin\xff\xfe",
            headers: Some(good_headers),
            payload: b"p-bin-subject-h",
        },
        Raw::good(b"orders.bin\xc3", b"p-bin-subject"),
        Raw::good(b"orders.good.5", b"g5"),
        // UTF-8, but with a no-break space, which the client once took for an argument break.
        Raw {
            subject: "orders.no\u{a0}break".as_bytes(),
            headers: Some(good_headers),
            payload: b"p-nbsp",
        },
        Raw {
            subject: b"orders.forged",
            headers: Some(forged),
            payload: b"p-forged",
        },
        Raw::good(b"orders.good.6", b"g6"),
    ];
    publish_raw(&server, &messages).await;
    let total = messages.len();
    wait_until(
        "the stream stored every raw publish",
        Duration::from_secs(10),
        || async { js.consumer_info(STREAM, "poison").await.num_pending == total as u64 },
    )
    .await;

    let mut leased = fetch_count(&gateway, total, Duration::from_secs(20)).await;
    leased.sort_by_key(|m| m.stream_sequence);
    let sequences: Vec<u64> = leased.iter().map(|m| m.stream_sequence).collect();
    assert_eq!(
        sequences,
        (1..=total as u64).collect::<Vec<_>>(),
        "every message leased exactly once"
    );

    for (sent, got) in messages.iter().zip(&leased) {
        let context = format!("{:?}", String::from_utf8_lossy(sent.subject));
        assert_eq!(got.delivered, 1, "{context}: first delivery");
        assert_eq!(got.payload(), sent.payload, "{context}: payload");
        // The subject: as text when it is UTF-8, else its exact bytes in `subject_base64`
        // and the lossy text in `subject`.
        match std::str::from_utf8(sent.subject) {
            Ok(text) => {
                assert_eq!(got.subject, text, "{context}");
                assert_eq!(got.subject_base64, None, "{context}");
            }
            Err(_) => {
                let raw = got
                    .subject_base64
                    .as_deref()
                    .unwrap_or_else(|| panic!("{context}: no subject_base64"));
                assert_eq!(STANDARD.decode(raw).expect("base64"), sent.subject);
                assert_eq!(got.subject, String::from_utf8_lossy(sent.subject));
            }
        }
        // Headers: parsed when they can be, else the exact block in `headers_base64`.
        match sent.headers {
            Some(block) if block != good_headers => {
                let raw = got
                    .headers_base64
                    .as_deref()
                    .unwrap_or_else(|| panic!("{context}: no headers_base64"));
                assert_eq!(STANDARD.decode(raw).expect("base64"), block, "{context}");
                assert!(got.headers.is_empty(), "{context}: {:?}", got.headers);
            }
            Some(_) => {
                assert_eq!(got.headers_base64, None, "{context}");
                assert_eq!(
                    got.headers,
                    json!({"X-Ok": ["yes"]})
                        .as_object()
                        .cloned()
                        .unwrap_or_default(),
                    "{context}"
                );
            }
            None => {
                assert_eq!(got.headers_base64, None, "{context}");
                assert!(got.headers.is_empty(), "{context}: {:?}", got.headers);
            }
        }
    }

    // The connection never dropped for any of them.
    let scrape = Scrape::of(&gateway).await;
    assert_eq!(scrape.get("ruststream_nats_reconnects_total"), 0.0);
    assert_eq!(scrape.get("ruststream_nats_connected"), 1.0);

    // Settled like any other: acked, none comes back.
    for message in &leased {
        assert_eq!(gateway.ack(&message.id).await, 204, "{}", message.subject);
    }
    let info = js.consumer_info(STREAM, "poison").await;
    assert_eq!((info.num_ack_pending, info.num_pending), (0, 0));
    assert_eq!(info.num_redelivered, 0, "nothing was delivered twice");
    assert!(gateway.fetch_n(10, 300).await.is_empty());
}
