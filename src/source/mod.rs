//! Sources: where ray-xds learns which RayServices exist and where their proxies are.
//!
//! Each source is the single writer of its own `watch` channel of [`Model`]s; the
//! pipeline reads it. A source publishes only valid models: bad input is logged,
//! counted in `ray_xds_source_rejected_total` and skipped, and the last good model stays.

pub mod file;

pub use crate::model::Model;
