//! Live state: what ray-xds learns from the running Ray clusters themselves, as opposed
//! to what a source says should exist.
//!
//! - [`probe`] and [`prober`]: every Ray Serve proxy probed directly, its route table
//!   kept in [`route_tables`] and read in turns from [`route_turns`];
//! - [`dashboard`] and [`dashboards`]: each cluster's Ray dashboard, the authority on
//!   application status, polled;
//! - [`target_groups`]: Ray's direct ingress, each application's ingress replicas, as a
//!   dashboard answer lists them;
//! - [`discovery`]: the pure step that gives a cluster known only by its dashboard the
//!   proxies that dashboard lists, and every cluster its applications and their replicas;
//! - [`health`]: the pure combination of all of it into each endpoint's health;
//! - [`peers`]: what the other ray-xds replicas say of their switchovers;
//! - [`state_store`]: where each replica keeps its own, for a restart of every replica.

pub mod dashboard;
pub mod dashboards;
pub mod discovery;
pub mod health;
pub mod peers;
pub mod probe;
pub mod prober;
pub mod route_tables;
pub(crate) mod route_turns;
pub mod state_store;
pub mod target_groups;
