//! Real Envoy 1.40 fed by ray-xds, carrying real requests (HTTP, gRPC, WebSocket, streams)
//! to simulated Ray Serve proxies: the xDS conformance table, live health, traffic policy,
//! safety (a request that may have run is never sent again), the readiness-gated
//! switchover, mTLS, and Ray's direct ingress.

mod conformance;
mod direct_ingress;
mod e2e;
mod grpc;
mod grpc_hostile;
mod health;
mod policy;
mod safety;
mod switchover;
mod tls;
