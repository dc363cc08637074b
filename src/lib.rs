//! ray-xds: an xDS control plane that keeps Envoy in front of Ray Serve.
//!
//! The modules follow the data flow, bottom layer first (no module imports one above it):
//!
//! - [`policy`]: every tunable setting (probe, dashboard, traffic, switchover), declared
//!   once, with its default, range, flag and annotation;
//! - [`model`]: the domain model, free of Kubernetes and protobuf types;
//! - [`config`]: command line, environment and config file → a typed [`config::Config`];
//! - [`xds`]: Envoy's side only: versioned consistent snapshots, sans-IO ADS state
//!   machines (state of the world and delta) and the thin gRPC server around them;
//! - [`source`]: where RayServices come from (a watched `services.yaml`, or Kubernetes),
//!   each source the single writer of a [`model::Model`];
//! - [`live`]: what the running clusters say (proxy probes, dashboards, discovery) and
//!   [`live::health`], the one authority on each endpoint's health;
//! - [`translate`]: the pure function from a model and its health to Envoy resources;
//! - [`pipeline`]: the pure step from all inputs to a snapshot (switchover, departed
//!   clusters, withheld proxies), and the task that runs it;
//! - [`metrics`] and [`admin`]: Prometheus, health, readiness and debug views;
//! - [`supervisor`]: restarts a component that fails, counts it, shows it down;
//! - [`memory`]: gives the heap a burst of syncs freed back to the operating system;
//! - [`runtime`]: wiring, one shutdown token for everything.

pub mod admin;
pub mod admin_listener;
pub mod budget;
pub mod config;
pub mod live;
pub mod memory;
pub mod metrics;
pub mod model;
pub mod peer_counts;
pub mod pipeline;
pub mod policy;
pub mod ray_serve_api;
pub mod runtime;
pub mod source;
pub mod supervisor;
pub mod translate;
pub mod xds;
