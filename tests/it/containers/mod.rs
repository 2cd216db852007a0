//! The container files stay in step with the code: every flag and RUSTSTREAM_*/NATS_*
//! variable that `docker-compose.yml` and the `Dockerfile` give the gateway exists in the clap
//! `Config` and parses (and where a flag and its variable are both given, they agree); the
//! compose stack has JetStream with a volume, a one-shot job that creates ORDERS before the
//! gateways start, and three gateway replicas on 0.0.0.0:8080 on one stream and consumer,
//! sharing one `--lease-key-file` that another one-shot job generates into a named volume;
//! no replica publishes a port: a balancer (deploy/compose/balancer.conf) publishes 8080 and
//! spreads requests over every replica, nothing sticky; the image runs as a non-root user
//! with a HEALTHCHECK on /healthz, which `--healthcheck` really performs.
//! (No Docker engine on the build machines: `scripts/containers.sh` has docker-compose parse
//! the compose file, this checks what it means.)

mod compose;
mod dockerfile;
pub(crate) mod files;
