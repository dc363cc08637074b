//! The Kubernetes source: the fake API server against the real kube-rs client, the
//! source end to end (fake API server, simulated Ray, a real Envoy), host ownership
//! between namespaces, the manifests in `deploy/`, and the replicas' state in a ConfigMap.

mod deploy_manifests;
mod fake_apiserver;
mod hosts_hostile;
mod source;
mod state_store;
