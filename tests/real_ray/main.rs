//! Real Ray Serve 2.60 in the loop (`crates/test-support/src/real_ray/`): real clusters, their
//! real dashboards and proxies, a real Envoy in front; the proxies' way and Ray's direct
//! ingress. Every test is named `real_ray_*`; they are heavy (a Ray node takes ~15 s and
//! ~1 GB to start), so `scripts/test.sh` runs them one at a time, after the others.

mod capacity;
mod direct_ingress;
mod outcomes;
mod prestop;
mod serve;
