//! `--nats-url` taken apart: one or more servers, the credentials a URL may carry given to
//! the client as connect options instead (the client logs server addresses), and the URL as
//! logs and errors may show it, credentials masked.
//!
//! May import: the rest of `config`.

use super::{Config, Secret};

impl Config {
    /// `--nats-url` as messages and logs show it: credentials in a URL (`user:password@`,
    /// `token@`) replaced by `***`, so no error or log line carries them.
    pub fn nats_url_redacted(&self) -> String {
        redact_url_credentials(&self.nats_url)
    }
}

/// Credentials written into `--nats-url` (`user:password@`, `token@`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UrlCredentials {
    UserPassword(String, Secret),
    Token(Secret),
}

/// `--nats-url` ready for the NATS client: the servers without user info, and the
/// credentials they carried, to be given as connect options instead (the client logs server
/// addresses at debug, so a URL must never carry a secret past this point).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsServers {
    pub urls: Vec<String>,
    pub credentials: Option<UrlCredentials>,
}

impl Config {
    /// Split `--nats-url` into [`NatsServers`]. Refuses URLs carrying different credentials,
    /// and credentials in a URL together with --nats-user/--nats-token/--nats-creds/--nats-nkey
    /// (which would win is not obvious). Errors never show a secret.
    pub fn nats_servers(&self) -> Result<NatsServers, String> {
        let mut urls = Vec::new();
        let mut credentials = None;
        for url in self.nats_url.split(',').map(str::trim) {
            if url.is_empty() {
                continue;
            }
            let (without, found) = split_url_credentials(url);
            urls.push(without);
            let Some(found) = found else { continue };
            if credentials.as_ref().is_some_and(|seen| *seen != found) {
                return Err(format!(
                    "the URLs of --nats-url carry different credentials ({}): give one set",
                    self.nats_url_redacted()
                ));
            }
            credentials = Some(found);
        }
        let other_auth = self.nats_user.is_some()
            || self.nats_token.is_some()
            || self.nats_creds.is_some()
            || self.nats_nkey.is_some();
        if credentials.is_some() && other_auth {
            return Err(format!(
                "--nats-url ({}) carries credentials and --nats-user/--nats-token/--nats-creds/\
                 --nats-nkey is given too: give the NATS credentials one way",
                self.nats_url_redacted()
            ));
        }
        Ok(NatsServers { urls, credentials })
    }
}

/// The byte range of a URL's authority (after `scheme://`, before the path).
fn authority(url: &str) -> (usize, usize) {
    let start = url.find("://").map_or(0, |at| at + 3);
    let end = url[start..]
        .find(['/', '?', '#'])
        .map_or(url.len(), |end| start + end);
    (start, end)
}

/// A URL without its user info, and the credentials that user info held (percent-decoded).
fn split_url_credentials(url: &str) -> (String, Option<UrlCredentials>) {
    let (start, end) = authority(url);
    let Some(at) = url[start..end].rfind('@') else {
        return (url.to_owned(), None);
    };
    let userinfo = &url[start..start + at];
    let without = format!("{}{}", &url[..start], &url[start + at + 1..]);
    let decode = |text: &str| {
        percent_encoding::percent_decode_str(text)
            .decode_utf8_lossy()
            .into_owned()
    };
    let credentials = match userinfo.split_once(':') {
        Some((user, password)) => {
            UrlCredentials::UserPassword(decode(user), Secret(decode(password)))
        }
        None => UrlCredentials::Token(Secret(decode(userinfo))),
    };
    (without, Some(credentials))
}

/// Each comma-separated URL with its user info (before `@` in the authority) masked.
fn redact_url_credentials(urls: &str) -> String {
    urls.split(',')
        .map(|url| {
            let (start, end) = authority(url);
            match url[start..end].rfind('@') {
                Some(at) => format!("{}***{}", &url[..start], &url[start + at..]),
                None => url.to_owned(),
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// `--nats-url`: one or more comma-separated URLs (empty entries between commas are skipped).
pub(super) fn parse_nats_urls(value: &str) -> Result<String, String> {
    let urls: Vec<&str> = value.split(',').map(str::trim).collect();
    if urls.iter().all(|url| url.is_empty()) {
        return Err(
            "names no NATS server: give at least one URL, e.g. nats://127.0.0.1:4222".into(),
        );
    }
    Ok(value.to_owned())
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    #[test]
    fn credentials_in_nats_urls_are_masked() {
        assert_eq!(
            redact_url_credentials("nats://user:pa55@nats:4222,tls://t0ken@other:4443/x"),
            "nats://***@nats:4222,tls://***@other:4443/x"
        );
        assert_eq!(
            redact_url_credentials("nats://127.0.0.1:4222"),
            "nats://127.0.0.1:4222"
        );
        assert_eq!(redact_url_credentials("u:p@host:4222"), "***@host:4222");
    }

    #[test]
    fn credentials_leave_nats_urls_as_connect_options() {
        let parse = |args: &[&str]| {
            let mut all = vec!["ruststream-nats"];
            all.extend_from_slice(args);
            Config::try_parse_from(all).expect("parses").nats_servers()
        };
        let servers = parse(&[
            "--nats-url",
            "nats://alice:p%40ss@a:4222, nats://alice:p%40ss@b",
        ])
        .expect("one set of credentials");
        assert_eq!(servers.urls, ["nats://a:4222", "nats://b"]);
        assert_eq!(
            servers.credentials,
            Some(UrlCredentials::UserPassword(
                "alice".into(),
                Secret("p@ss".into())
            ))
        );
        let servers = parse(&["--nats-url", "tls://t0ken@a:4443/x"]).expect("a token");
        assert_eq!(servers.urls, ["tls://a:4443/x"]);
        assert_eq!(
            servers.credentials,
            Some(UrlCredentials::Token(Secret("t0ken".into())))
        );
        let servers = parse(&["--nats-url", "nats://a:4222"]).expect("none");
        assert_eq!((servers.urls.len(), servers.credentials), (1, None));

        let refused =
            parse(&["--nats-url", "nats://u:secret1@a,nats://u:other@b"]).expect_err("two sets");
        assert!(!refused.contains("secret1"), "{refused}");
        let refused = parse(&["--nats-url", "nats://u:secret1@a", "--nats-token", "t"])
            .expect_err("URL credentials and --nats-token");
        assert!(
            refused.contains("one way") && !refused.contains("secret1"),
            "{refused}"
        );
        assert!(
            parse(&[
                "--nats-url",
                "nats://t@a",
                "--nats-user",
                "u",
                "--nats-password",
                "p"
            ])
            .is_err()
        );
    }
}
