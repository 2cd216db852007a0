//! `ruststream-nats --healthcheck <URL>`: GET a URL and succeed only on 200, so that a
//! container's `HEALTHCHECK` needs no curl (or shell) in the runtime image.
//!
//! Plain HTTP/1.1 over a blocking socket with timeouts: one request, to the gateway on its
//! own loopback, is all it does, so no HTTP client crate is pulled in for it.
//!
//! May import: nothing of the crate; `main.rs` calls it instead of serving.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use axum::http::Uri;

/// GET `url` (`http://host:port/path`) and return `Ok` when it answers 200 within `timeout`
/// (per connect, write and read); otherwise say why.
pub fn check(url: &str, timeout: Duration) -> Result<(), String> {
    let uri: Uri = url
        .parse()
        .map_err(|err| format!("bad URL {url:?}: {err}"))?;
    if uri.scheme_str() != Some("http") {
        return Err(format!("only http:// URLs can be checked, got {url:?}"));
    }
    let host = uri
        .host()
        .ok_or_else(|| format!("no host in {url:?}"))?
        .trim_start_matches('[')
        .trim_end_matches(']');
    let port = uri.port_u16().unwrap_or(80);
    let path = uri.path_and_query().map_or("/", |path| path.as_str());
    let address = (host, port)
        .to_socket_addrs()
        .map_err(|err| format!("cannot resolve {host}:{port}: {err}"))?
        .next()
        .ok_or_else(|| format!("{host}:{port} resolves to no address"))?;
    let mut stream = TcpStream::connect_timeout(&address, timeout)
        .map_err(|err| format!("cannot connect to {address}: {err}"))?;
    stream
        .set_read_timeout(Some(timeout))
        .and_then(|()| stream.set_write_timeout(Some(timeout)))
        .map_err(|err| format!("socket timeouts: {err}"))?;
    let request =
        format!("GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n");
    stream
        .write_all(request.as_bytes())
        .map_err(|err| format!("sending the request: {err}"))?;
    // The status line is all that matters; it comes first.
    let mut head = [0u8; 64];
    let mut read = 0;
    while read < head.len() && !head[..read].contains(&b'\n') {
        match stream.read(&mut head[read..]) {
            Ok(0) => break,
            Ok(n) => read += n,
            Err(err) => return Err(format!("reading the answer: {err}")),
        }
    }
    let status_line = String::from_utf8_lossy(&head[..read]);
    let status_line = status_line.lines().next().unwrap_or_default();
    match status_line.split_whitespace().nth(1) {
        Some("200") => Ok(()),
        Some(_) => Err(format!("{url} answered {status_line:?}")),
        None => Err(format!("{url} answered no HTTP status line")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_what_it_cannot_check() {
        let timeout = Duration::from_secs(1);
        assert!(check("https://127.0.0.1:8080/healthz", timeout).is_err());
        assert!(check("not a url", timeout).is_err());
        // Nothing listens on a port just released.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .expect("a free port")
            .port();
        let err = check(&format!("http://127.0.0.1:{port}/healthz"), timeout)
            .expect_err("nothing listens");
        assert!(err.contains("cannot connect"), "{err}");
    }
}
