//! The xDS server: Envoy's Aggregated Discovery Service, state of the world and delta.
//!
//! - [`snapshot`]: versioned, shared, encoded resources (what is served);
//! - [`ordering`]: make-before-break rules shared by both protocols;
//! - [`sotw`] and [`delta`]: one sans-IO state machine per stream, turning requests and
//!   snapshots into responses, unit-tested without sockets;
//! - [`server`]: one task per stream, reading the latest snapshot from a `watch`
//!   channel (latest state wins; nothing queues per stream);
//! - [`grpc`]: the gRPC service around it: tonic transport and request decoding, our own
//!   response framing.

pub mod delta;
pub mod grpc;
pub mod ordering;
pub mod server;
pub mod snapshot;
pub mod sotw;

use serde::Serialize;

use envoy_types::pb::envoy::config::core::v3::Node;

pub use snapshot::{ResourceType, Snapshot};

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
}

impl ProtocolError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            ProtocolError::UnknownType(_) => "unknown_type",
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
            id: node.id.clone(),
            cluster: node.cluster.clone(),
            user_agent: format!("{} {}", node.user_agent_name, version)
                .trim()
                .to_string(),
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
}

/// A protocol state machine driven by the stream task in [`server`].
pub trait AdsProtocol: Send + 'static {
    type Request: prost::Message + Default + Send + 'static;
    type Response: prost::Message + Send + 'static;
    const NAME: &'static str;

    fn on_request(&mut self, request: Self::Request) -> Result<Event, ProtocolError>;
    /// The response to send now for one type, if any, with the number of resources it
    /// carries.
    fn poll_type(
        &mut self,
        ty: ResourceType,
        snapshot: &Snapshot,
    ) -> Option<(ResourceType, usize, Self::Response)>;

    /// Responses to send now for `snapshot`, in make-before-break push order.
    fn poll(&mut self, snapshot: &Snapshot) -> Vec<(ResourceType, usize, Self::Response)> {
        ResourceType::ALL
            .into_iter()
            .filter_map(|ty| self.poll_type(ty, snapshot))
            .collect()
    }
    fn node(&self) -> Option<&NodeInfo>;
    fn status(&self) -> Vec<(ResourceType, TypeStatus)>;
    /// Whether this Envoy has ACKed `cluster` and its endpoints; `None` when it does not
    /// subscribe to that cluster (it has nothing to warm).
    fn warmed(&self, cluster: &str) -> Option<bool>;
}
