//! An xDS server: Envoy's Aggregated Discovery Service, state of the world and delta.
//! It knows Envoy and the xDS protocol, nothing of Ray; ray-xds (the crate above it)
//! builds the snapshots it serves.
//!
//! The public API is small: a [`Snapshot`] to serve (from [`Resources`]), an
//! [`Observer`] to report to, the [`server`] that serves a `watch` of snapshots over
//! gRPC, and [`Clients`], what every connected Envoy holds. Around it:
//!
//! - [`snapshot`]: versioned, shared, encoded resources (what is served);
//! - [`ordering`], [`holding`] and [`names`], shared by both protocols: the make-before-break
//!   rules, what one Envoy holds and rejected of a type (its ledger), the subscribed names;
//! - [`sotw`] and [`delta`]: one sans-IO state machine per stream, turning requests and
//!   snapshots into responses, unit-tested without sockets;
//! - [`server`]: one task per stream, reading the latest snapshot from a `watch`
//!   channel (latest state wins; nothing queues per stream), reporting to an
//!   [`Observer`];
//! - [`clients`]: the connected streams, what each Envoy holds, which have warmed what;
//! - [`codec`] and [`grpc`]: gRPC framing and the tower service around the streams;
//! - [`json`]: Envoy messages as proto JSON, for the debug views;
//! - [`gate`], [`listener`] and [`tls`]: the one connection cap of every listener (in
//!   all and per peer address; ray-xds's admin port uses it too), the xDS port's
//!   connections (handshake and idle timeouts) and its mTLS;
//! - [`handshakes`]: TLS handshakes metered per address and run on a thread of their
//!   own, so a flood of them cannot starve the probes;
//! - [`lrs`]: Envoy's Load Reporting Service, what each Envoy's requests to each cluster
//!   came to, summed per tracked cluster over a window;
//! - [`budget`]: a memory bound shared fairly between owners;
//! - [`responses`]: the bound on response bytes built and not yet written, across every
//!   stream.
//!
//! This layer knows Envoy and the xDS protocol, not Ray: it serves whatever consistent
//! [`Snapshot`] it is given, and reports through [`Observer`] and [`Clients`] instead of
//! importing anything of the domain.

pub mod budget;
pub(crate) mod clients;
pub mod codec;
pub mod csds;
pub mod delta;
#[cfg(test)]
mod envoy_model;
#[cfg(test)]
pub(crate) mod fixtures;
pub mod gate;
pub mod grpc;
pub mod handshakes;
pub mod holding;
pub mod json;
pub mod listener;
pub mod lrs;
pub mod names;
pub mod ordering;
pub mod responses;
pub mod server;
pub mod snapshot;
pub mod sotw;
pub mod tls;

use std::sync::Arc;

use serde::Serialize;

use envoy_types::pb::envoy::config::core::v3::Node;

pub use clients::Clients;
pub use snapshot::{Encoded, EnvoyResource, Inconsistent, Memo, ResourceType, Resources, Snapshot};

/// What the server reports as streams come, go and exchange messages: ray-xds counts it
/// in its metrics. Every method does nothing by default.
pub trait Observer: Send + Sync + 'static {
    fn stream_opened(&self, _protocol: &'static str) {}
    fn stream_closed(&self, _protocol: &'static str) {}
    /// A stream's first request for a type.
    fn subscribed(&self, _protocol: &'static str, _ty: ResourceType) {}
    /// A stream that had subscribed to a type ended.
    fn unsubscribed(&self, _protocol: &'static str, _ty: ResourceType) {}
    fn pushed(&self, _protocol: &'static str, _ty: ResourceType, _resources: usize) {}
    fn acked(&self, _protocol: &'static str, _ty: ResourceType) {}
    fn nacked(&self, _protocol: &'static str, _ty: ResourceType) {}
    /// A stream ended on a client error (`reason` is a short metric label).
    fn stream_error(&self, _protocol: &'static str, _reason: &'static str) {}
    /// The xDS listener's certificate files changed: read into a new configuration
    /// (`true`), or unusable, the last good one kept (`false`).
    fn tls_reload(&self, _ok: bool) {}
    /// A load reporting stream opened (`true`) or closed.
    fn load_stream(&self, _opened: bool) {}
    /// A load report: its cluster entries counted, skipped as untracked, or refused as
    /// not held by the reporting node.
    fn load_report(&self, _recorded: &lrs::Recorded) {}
    /// A load reporting stream refused or ended on a client error.
    fn load_report_refused(&self, _reason: &'static str) {}
}

/// Observes nothing.
impl Observer for () {}

/// What a request meant, for logs, metrics and `/debug/clients`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A first request for a type, or a subscription change.
    Subscribed(ResourceType),
    Ack {
        ty: ResourceType,
        version: String,
    },
    Nack {
        ty: ResourceType,
        version: String,
        message: String,
    },
    /// A request answering a response that has since been superseded: ignored.
    Stale(ResourceType),
}

/// A request the server refuses; the stream ends with an error (that stream only).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    #[error("unknown type_url {0:?}: ray-xds serves clusters, endpoints, listeners and routes")]
    UnknownType(String),
    #[error("{0} resource names of one type on one stream, over the {MAX_NAMES_PER_TYPE} a client may subscribe to")]
    TooManyNames(usize),
    #[error("a resource name of {0} bytes, over the {MAX_NAME_BYTES} a name may have")]
    NameTooLong(usize),
}

/// The longest resource name a client may send (ray-xds's names are
/// `<namespace>/<rayservice>/<cluster>`, well under it): with [`MAX_NAMES_PER_TYPE`],
/// bounds the bytes one stream's subscriptions hold.
pub const MAX_NAME_BYTES: usize = 1024;

/// Refuses a request naming a resource longer than [`MAX_NAME_BYTES`].
pub fn check_name_lengths<'a, S: AsRef<str> + 'a>(
    names: impl IntoIterator<Item = &'a S>,
) -> Result<(), ProtocolError> {
    match names.into_iter().map(|n| n.as_ref().len()).max() {
        Some(len) if len > MAX_NAME_BYTES => Err(ProtocolError::NameTooLong(len)),
        _ => Ok(()),
    }
}

/// The most resource names of one type a stream may subscribe to (an Envoy subscribes
/// to one endpoints name per cluster): bounds what one client makes a stream hold.
pub const MAX_NAMES_PER_TYPE: usize = 20_000;

/// `text` cut to at most `max` bytes (on a character boundary), saying so: an Envoy's
/// error message is outside input, logged and shown.
pub fn clip(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes in all)", &text[..end], text.len())
}

/// At most this many subscribed names are listed per type in `/debug/clients`.
pub const NAMES_SHOWN: usize = 1000;

/// The names to show of a subscription: the first [`NAMES_SHOWN`], then how many more.
pub fn shown_names(names: impl ExactSizeIterator<Item = String>) -> Vec<String> {
    let total = names.len();
    let mut shown: Vec<String> = names.take(NAMES_SHOWN).collect();
    if total > NAMES_SHOWN {
        shown.push(format!("… and {} more", total - NAMES_SHOWN));
    }
    shown
}

impl ProtocolError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            ProtocolError::UnknownType(_) => "unknown_type",
            ProtocolError::TooManyNames(_) => "too_many_names",
            ProtocolError::NameTooLong(_) => "name_too_long",
        }
    }
}

/// The Envoy on the other end of a stream, as it described itself.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct NodeInfo {
    pub id: String,
    pub cluster: String,
    pub user_agent: String,
}

/// The most bytes kept of a node's id, cluster and user agent (an Envoy's are tens): a
/// client's view stays small however long what it sends.
pub const MAX_NODE_FIELD_BYTES: usize = 512;

impl NodeInfo {
    pub fn from_node(node: &Node) -> NodeInfo {
        use envoy_types::pb::envoy::config::core::v3::node::UserAgentVersionType;
        let version = match &node.user_agent_version_type {
            Some(UserAgentVersionType::UserAgentVersion(v)) => v.clone(),
            Some(UserAgentVersionType::UserAgentBuildVersion(b)) => b
                .version
                .as_ref()
                .map(|v| format!("{}.{}.{}", v.major_number, v.minor_number, v.patch))
                .unwrap_or_default(),
            None => String::new(),
        };
        NodeInfo {
            id: clip(&node.id, MAX_NODE_FIELD_BYTES),
            cluster: clip(&node.cluster, MAX_NODE_FIELD_BYTES),
            user_agent: clip(
                format!("{} {}", node.user_agent_name, version).trim(),
                MAX_NODE_FIELD_BYTES,
            ),
        }
    }
}

/// One type's state on one stream, as shown by `/debug/clients`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TypeStatus {
    /// `["*"]` for a wildcard subscription.
    pub subscribed: Vec<String>,
    pub last_acked_version: Option<String>,
    pub last_nacked_version: Option<String>,
    pub last_nack_message: Option<String>,
    pub pushes: u64,
    pub acks: u64,
    pub nacks: u64,
    pub resources_held: usize,
    /// True when the Envoy holds exactly one snapshot's whole set of this type (the
    /// steady state), which the stream keeps as a shared pointer.
    pub holds_snapshot_set: bool,
    /// Resources whose current version the Envoy rejected (it keeps what it had).
    pub rejected: Vec<String>,
}

/// A protocol state machine driven by the stream task in [`server`].
pub trait AdsProtocol: Send + 'static {
    type Request: prost::Message + Default + Send + 'static;
    /// The request as the server decodes it: the same message on the wire, perhaps
    /// lighter to decode than `Request`.
    type Wire: prost::Message + Default + Send + From<Self::Request> + 'static;
    type Response: prost::Message + Send + 'static;
    const NAME: &'static str;

    fn on_request(&mut self, request: Self::Request) -> Result<Event, ProtocolError>;
    /// [`AdsProtocol::on_request`] for a request as the server decoded it.
    fn on_wire(&mut self, request: Self::Wire) -> Result<Event, ProtocolError>;
    /// The response to send now for one type, if any, with the number of resources it
    /// carries.
    fn poll_type(
        &mut self,
        ty: ResourceType,
        snapshot: &Snapshot,
    ) -> Option<(ResourceType, usize, Self::Response)>;

    /// Responses to send now for `snapshot`, in make-before-break push order. A pass can
    /// learn something (a reconnected Envoy turns out to hold the route we would send)
    /// that lets an earlier type go, so passes repeat until one sends nothing new.
    fn poll(&mut self, snapshot: &Snapshot) -> Vec<(ResourceType, usize, Self::Response)> {
        let mut out = Vec::new();
        for pass in 0.. {
            let before = out.len();
            out.extend(
                ResourceType::ALL
                    .into_iter()
                    .filter_map(|ty| self.poll_type(ty, snapshot)),
            );
            // At most one response per type is in flight, so this ends by the fifth pass.
            if pass > 0 && out.len() == before {
                break;
            }
        }
        out
    }
    fn node(&self) -> Option<&NodeInfo>;
    fn status(&self) -> Vec<(ResourceType, TypeStatus)>;
    /// Whether this Envoy has ACKed `cluster` and its endpoints; `None` when it does not
    /// subscribe to that cluster (it has nothing to warm).
    fn warmed(&self, cluster: &str) -> Option<bool>;
    /// Whether this Envoy rejected (NACKed) `cluster` or its endpoints as the current
    /// snapshot has them.
    fn rejected(&self, cluster: &str) -> bool;
    /// A reconnected Envoy has not yet declared everything it holds, so some removals
    /// wait. The stream task ends the wait after [`server::RECONNECT_WAIT`] in any case
    /// (an Envoy that holds no routes never declares any).
    fn awaiting_reconnect(&self) -> bool;
    /// Ends the wait for a reconnected Envoy's declarations.
    fn settle_reconnect(&mut self);
    /// What the Envoy holds of `ty` (ACKed, or reported on reconnect): name and version.
    fn held(&self, ty: ResourceType) -> Vec<(Arc<str>, Arc<str>)>;
    /// What it subscribes to of `ty`: `None` when it has not asked for the type,
    /// `Some(None)` for a wildcard, else the names.
    fn subscription(&self, ty: ResourceType) -> Option<Option<Vec<Arc<str>>>>;
    /// The version of `name` of `ty` it holds, if it holds it.
    fn holds(&self, ty: ResourceType, name: &str) -> Option<Arc<str>>;
}
