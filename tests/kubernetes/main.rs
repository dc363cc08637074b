//! The Kubernetes source: the fake API server against the real kube-rs client, the
//! source end to end (fake API server, simulated Ray, a real Envoy), host ownership
//! between namespaces, and the manifests in `deploy/`.

mod deploy_manifests;
mod fake_apiserver;
mod hosts_hostile;
mod source;
