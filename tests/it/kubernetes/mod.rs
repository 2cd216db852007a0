//! The Kubernetes manifests (`deploy/kubernetes/`) stay in step with the code and the image,
//! checked the way `containers/` checks the Docker files: the kustomization lists files that
//! exist; every flag and RUSTSTREAM_*/NATS_* variable the Deployment gives the gateway exists
//! and parses; the probes ask /healthz and /readyz on the port `--admin-listen` really serves
//! (and the gateway answers them there, tokens or not); ports agree between the args, the
//! container, the probes and the Service; the termination grace period outlasts the preStop
//! wait and the shutdown; the pods run as the Dockerfile's USER, locked down; three replicas
//! under a disruption budget that selects them, behind a Service with no session affinity
//! (any replica settles any lease); every Secret mounted is defined and holds the file the
//! flags point to. (No cluster on the build machines: this checks what the YAML
//! means, not that an API server accepts it.)

mod cluster_policy;
mod gateway_pod;
mod manifests;
