//! What the dead-letter tests look at: the DLQ stream's letters and their headers, a message's
//! delivery, and the streams and consumers the gateway made.

use std::collections::BTreeMap;
use std::time::Duration;

use ruststream_nats::dead_letter::headers;

use crate::support::{Gateway, Js, Msg, wait_for};

pub(super) const DLQ: &str = "DLQ";

pub(super) async fn dlq_count(js: &Js) -> u64 {
    let mut stream = js.js.get_stream(DLQ).await.expect("DLQ stream");
    stream.info().await.expect("DLQ info").state.messages
}

/// Fetch until the message with `stream_sequence` is delivered for the `delivered`th time.
pub(super) async fn delivery(gateway: &Gateway, stream_sequence: u64, delivered: u64) -> Msg {
    wait_for(
        &format!("delivery {delivered} of stream sequence {stream_sequence}"),
        Duration::from_secs(10),
        || async move {
            gateway
                .fetch_n(10, 250)
                .await
                .into_iter()
                .find(|m| m.stream_sequence == stream_sequence && m.delivered == delivered)
        },
    )
    .await
}

pub(super) fn header<'a>(
    message: &'a async_nats::jetstream::message::StreamMessage,
    name: &str,
) -> &'a str {
    message
        .headers
        .get(name)
        .unwrap_or_else(|| panic!("dead letter has no {name} header: {:?}", message.headers))
        .as_str()
}

/// Every dead letter in the DLQ stream, by the stream sequence of its original.
pub(super) async fn dead_letters(
    js: &Js,
) -> BTreeMap<u64, async_nats::jetstream::message::StreamMessage> {
    let dlq = js.js.get_stream(DLQ).await.expect("DLQ stream");
    let mut letters = BTreeMap::new();
    for dlq_sequence in 1..=dlq_count(js).await {
        let letter = dlq
            .get_raw_message(dlq_sequence)
            .await
            .expect("a dead letter");
        let original: u64 = header(&letter, headers::STREAM_SEQUENCE)
            .parse()
            .expect("a stream sequence");
        assert!(
            letters.insert(original, letter).is_none(),
            "stream sequence {original} dead-lettered twice"
        );
    }
    letters
}

pub(super) async fn stream_count(js: &Js, name: &str) -> Option<u64> {
    let mut stream = js
        .js
        .get_stream(gateway_stream(js, name).await?)
        .await
        .ok()?;
    Some(stream.info().await.ok()?.state.messages)
}

/// The stream the gateway made whose name starts with `prefix` (its names end in a hash of
/// the stream and consumer names).
async fn gateway_stream(js: &Js, prefix: &str) -> Option<String> {
    use futures::TryStreamExt as _;
    let names: Vec<String> = js.js.stream_names().try_collect().await.ok()?;
    names.into_iter().find(|name| name.starts_with(prefix))
}

/// The names of the consumers on stream `name`.
pub(super) async fn consumer_names(js: &Js, name: &str) -> Vec<String> {
    use futures::TryStreamExt as _;
    let stream = js.js.get_stream(name).await.expect("stream");
    let mut names: Vec<String> = stream.consumer_names().try_collect().await.expect("names");
    names.sort();
    names
}

/// The gateway's advisory streams.
pub(super) async fn advisory_streams(js: &Js) -> Vec<String> {
    use futures::TryStreamExt as _;
    let names: Vec<String> = js.js.stream_names().try_collect().await.expect("names");
    names
        .into_iter()
        .filter(|name| name.starts_with("RUSTSTREAM_ADVISORIES_"))
        .collect()
}
