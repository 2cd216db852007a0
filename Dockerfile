# Container image of the gateway.
#   docker build -t ruststream-nats .
#   docker run --rm -p 8080:8080 -e NATS_URL=nats://<nats-host>:4222 ruststream-nats
# docker-compose.yml runs it together with a JetStream nats-server and the ORDERS stream.
# Every flag can be given as an argument (`docker run ... ruststream-nats --stream X`) or
# through its environment variable (see `--help`).

FROM rust:1-slim-bookworm AS builder
WORKDIR /src

# 1) Dependencies only, in a layer of their own: it is rebuilt when Cargo.toml or Cargo.lock
#    change, not on every source edit. Stub sources stand in for the crate's own targets
#    (lib, the binary, and any target that Cargo.toml gives an explicit path), and
#    the crate's own artifacts are removed afterwards so step 2 always rebuilds it.
#    vendor/ holds patched dependencies (Cargo.toml's [patch.crates-io] points there), so it
#    belongs to this layer: without it the dependency build cannot resolve them.
COPY Cargo.toml Cargo.lock ./
COPY vendor/ vendor/
RUN set -eu; \
    mkdir -p src; \
    echo 'fn main() {}' > src/main.rs; \
    : > src/lib.rs; \
    for p in $(sed -n 's/^[[:space:]]*path[[:space:]]*=[[:space:]]*"\([^"]*\.rs\)".*/\1/p' Cargo.toml); do \
        mkdir -p "$(dirname "$p")"; [ -e "$p" ] || echo 'fn main() {}' > "$p"; \
    done; \
    cargo build --release --locked --bin ruststream-nats; \
    rm -rf src target/release/.fingerprint/ruststream* target/release/deps/ruststream* \
        target/release/deps/libruststream* target/release/ruststream*

# 2) The crate itself (.dockerignore keeps target/, .venv/, .tools/ and .git/ out).
COPY . .
RUN cargo build --release --locked --bin ruststream-nats \
    && install -m 0755 target/release/ruststream-nats /usr/local/bin/ruststream-nats


# Runtime: distroless "cc" (glibc, libgcc, CA certificates for tls:// NATS URLs; no shell, no
# package manager), the same Debian 12 as the builder, about 25 MB with the gateway. Its
# "nonroot" variant runs as uid/gid 65532.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=builder /usr/local/bin/ruststream-nats /usr/local/bin/ruststream-nats

# Listen on all interfaces inside the container (the binary's default is 127.0.0.1:8080).
ENV RUSTSTREAM_LISTEN=0.0.0.0:8080
EXPOSE 8080
# Numeric, so orchestrators can verify "runAsNonRoot" without looking up the name.
USER 65532:65532
# /healthz answers 200 whenever the process serves HTTP (/readyz tells whether NATS is
# bound). The image has no curl: the gateway binary does the GET itself (--healthcheck).
# The port must match RUSTSTREAM_LISTEN if you change it.
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 \
    CMD ["/usr/local/bin/ruststream-nats", "--healthcheck", "http://127.0.0.1:8080/healthz"]
# Exec form: the gateway is PID 1 and gets SIGTERM from `docker stop` itself, so it drains
# (naks what it holds) before it exits.
ENTRYPOINT ["/usr/local/bin/ruststream-nats"]
