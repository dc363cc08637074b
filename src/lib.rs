//! ray-xds: an xDS control plane that keeps Envoy in front of Ray Serve.
//!
//! The modules follow the data flow:
//!
//! - [`config`]: command line, environment and config file → a typed [`config::Config`];
//! - [`source`]: where RayServices come from (the watched `services.yaml` file now),
//!   each source the single writer of a [`model::Model`];
//! - [`model`]: the domain model, free of Kubernetes and protobuf types;
//! - [`policy`]: traffic policy (outlier detection, retries, timeouts) and its defaults;
//! - [`switchover`]: readiness-gated weights between a RayService's clusters;
//! - [`translate`]: the pure function from a model to Envoy resources;
//! - [`xds`]: versioned snapshots, sans-IO ADS state machines (state of the world and
//!   delta) and the thin tonic server around them;
//! - [`live`]: live state from the running clusters (proxy probes, dashboards);
//! - [`admin`] and [`metrics`]: health, readiness, Prometheus and debug views;
//! - [`runtime`]: wiring, one shutdown token for everything;
//! - [`sim`]: a simulated Ray Serve, for tests and the demo.

pub mod admin;
pub mod config;
pub mod live;
pub mod metrics;
pub mod model;
pub mod policy;
pub mod runtime;
pub mod sim;
pub mod source;
pub mod switchover;
pub mod translate;
pub mod xds;
