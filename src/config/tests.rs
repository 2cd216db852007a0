//! The command line's unit tests: defaults, value parsers (origins, durations, deliver
//! policies, subjects), refusals, and secrets kept out of `Debug`.

use super::*;

#[test]
fn an_origin_is_taken_exactly_and_anything_else_is_refused() {
    for good in [
        "https://app.example.com",
        "http://localhost:3000",
        "http://127.0.0.1:8080",
        "http://[::1]:8080",
    ] {
        assert_eq!(super::parse_origin(good).as_deref(), Ok(good), "{good}");
    }
    assert_eq!(
        super::parse_origin("HTTPS://App.Example.com").as_deref(),
        Ok("https://app.example.com")
    );
    for bad in [
        "*",
        "app.example.com",
        "https://app.example.com/",
        "https://app.example.com/path",
        "https://*.example.com",
        "https://user@app.example.com",
        "https://app.example.com:port",
        "ftp://app.example.com",
        "https://",
    ] {
        assert!(super::parse_origin(bad).is_err(), "{bad}");
    }
}

#[test]
fn defaults_match_the_documented_ones() {
    let config = Config::try_parse_from(["ruststream-nats"]).expect("defaults parse");
    assert_eq!(config.nats_url, "nats://127.0.0.1:4222");
    assert_eq!(config.stream, "ORDERS");
    assert_eq!(config.consumer, "billing");
    assert_eq!(config.filter_subject, None);
    assert_eq!(config.deliver_policy, DeliverPolicy::All);
    assert_eq!(config.ack_wait, Duration::from_secs(30));
    assert_eq!(config.max_ack_pending, 1024);
    assert_eq!(config.max_deliver, None);
    assert!(!config.ephemeral);
    assert_eq!(config.dead_letter_subject, None);
    assert_eq!(config.listen, "127.0.0.1:8080".parse().expect("addr"));
    assert_eq!(config.max_batch, 1000);
    assert_eq!(config.max_wait, Duration::from_secs(30));
    assert_eq!(config.max_body_bytes, 262_144);
    assert!(config.auth_tokens_file.is_none() && config.auth_tokens.is_none());
}

#[test]
fn secrets_never_show_in_debug_output() {
    let config = Config::try_parse_from([
        "ruststream-nats",
        "--nats-user",
        "alice",
        "--nats-password",
        "hunter2-password",
        "--auth-tokens",
        "tok-very-secret fetch",
    ])
    .expect("parses");
    let shown = format!("{config:?}");
    assert!(!shown.contains("hunter2-password"), "{shown}");
    assert!(!shown.contains("tok-very-secret"), "{shown}");
    assert_eq!(
        config.nats_password.as_ref().map(Secret::expose),
        Some("hunter2-password")
    );
}

#[test]
fn nats_auth_methods_exclude_each_other() {
    let refused = |args: &[&str]| {
        let mut all = vec!["ruststream-nats"];
        all.extend_from_slice(args);
        Config::try_parse_from(all).is_err()
    };
    assert!(refused(&["--nats-user", "a"]), "user needs a password");
    assert!(refused(&["--nats-password", "a"]), "password needs a user");
    assert!(refused(&[
        "--nats-token",
        "t",
        "--nats-user",
        "a",
        "--nats-password",
        "p"
    ]));
    assert!(refused(&["--nats-creds", "c", "--nats-nkey", "k"]));
    assert!(
        refused(&["--nats-tls-cert", "c"]),
        "a client cert needs its key"
    );
    assert!(refused(&["--max-wait", "31s"]));
    assert!(refused(&["--max-batch", "0"]));
}

#[test]
fn deliver_policies_parse() {
    assert_eq!("last".parse(), Ok(DeliverPolicy::Last));
    assert_eq!("new".parse(), Ok(DeliverPolicy::New));
    assert_eq!(
        "last-per-subject".parse(),
        Ok(DeliverPolicy::LastPerSubject)
    );
    assert_eq!(
        "by-start-sequence=42".parse(),
        Ok(DeliverPolicy::ByStartSequence(42))
    );
    let by_time: DeliverPolicy = "by-start-time=2026-01-02T03:04:05Z".parse().expect("time");
    assert_eq!(by_time.to_string(), "by-start-time=2026-01-02T03:04:05Z");
    assert!("by-start-sequence=0".parse::<DeliverPolicy>().is_err());
    assert!("by-start-time=yesterday".parse::<DeliverPolicy>().is_err());
    assert!("oldest".parse::<DeliverPolicy>().is_err());
}

#[test]
fn dead_letter_subjects_are_concrete() {
    let config = Config::try_parse_from(["ruststream-nats", "--dead-letter-subject", "DLQ.orders"])
        .expect("parses");
    assert_eq!(config.dead_letter_subject.as_deref(), Some("DLQ.orders"));
    for bad in ["DLQ.*", "DLQ.>", "", "$JS.x", "a..b"] {
        assert!(
            Config::try_parse_from(["ruststream-nats", "--dead-letter-subject", bad]).is_err(),
            "{bad:?} is refused"
        );
    }
}

#[test]
fn bad_durations_are_refused() {
    assert!(Config::try_parse_from(["ruststream-nats", "--ack-wait", "soon"]).is_err());
    assert!(Config::try_parse_from(["ruststream-nats", "--ack-wait", "0s"]).is_err());
    let config =
        Config::try_parse_from(["ruststream-nats", "--ack-wait", "1m 30s"]).expect("parses");
    assert_eq!(config.ack_wait, Duration::from_secs(90));
}
