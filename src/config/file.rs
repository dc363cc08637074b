//! `ray-xds.yaml`'s shape: one struct per section, every field optional (a flag or the
//! default fills what the file leaves out), unknown fields refused.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::{parse_bytes, KubernetesSourceConfig};
use crate::policy::{dashboard, probe, switchover, traffic};

/// A byte count in the config file: a number of bytes or a string [`parse_bytes`] reads.
#[derive(Debug, Clone, Copy)]
pub(super) struct ByteCount(pub(super) usize);

impl<'de> Deserialize<'de> for ByteCount {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = ByteCount;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str(
                    "a byte count: a whole number of bytes, or digits then Ki, Mi or Gi (e.g. 64Mi)",
                )
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<ByteCount, E> {
                usize::try_from(n)
                    .map(ByteCount)
                    .map_err(|_| E::custom(format!("{n} is too large")))
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<ByteCount, E> {
                u64::try_from(n)
                    .map_err(|_| E::custom(format!("{n} is not a byte count: it is negative")))
                    .and_then(|n| self.visit_u64(n))
            }
            fn visit_u128<E: serde::de::Error>(self, n: u128) -> Result<ByteCount, E> {
                Err(E::custom(format!("{n} is too large")))
            }
            fn visit_i128<E: serde::de::Error>(self, n: i128) -> Result<ByteCount, E> {
                Err(E::custom(format!("{n} is not a byte count")))
            }
            fn visit_f64<E: serde::de::Error>(self, n: f64) -> Result<ByteCount, E> {
                Err(E::custom(format!(
                    "{n} is not a byte count: use a whole number (e.g. 1572864 or 1536Ki)"
                )))
            }
            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<ByteCount, E> {
                parse_bytes(text).map(ByteCount).map_err(E::custom)
            }
        }
        d.deserialize_any(Visitor)
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileConfig {
    #[serde(default)]
    pub(super) xds: XdsSection,
    #[serde(default)]
    pub(super) admin: AdminSection,
    #[serde(default)]
    pub(super) gateway: GatewaySection,
    #[serde(default)]
    pub(super) source: Option<SourceSection>,
    #[serde(default)]
    pub(super) proxies: ProxiesSection,
    #[serde(default)]
    pub(super) probe: probe::GlobalProbe,
    #[serde(default)]
    pub(super) dashboard: dashboard::GlobalDashboard,
    #[serde(default)]
    pub(super) traffic: traffic::GlobalTraffic,
    #[serde(default)]
    pub(super) switchover: switchover::GlobalSwitchover,
    #[serde(default)]
    pub(super) memory: MemorySection,
    #[serde(default)]
    pub(super) replicas: ReplicasSection,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ReplicasSection {
    pub(super) peers: Option<Vec<String>>,
    #[serde(default, with = "humantime_serde")]
    pub(super) poll_interval: Option<Duration>,
    pub(super) state: Option<ReplicaStateSection>,
}

/// `replicas.state`: exactly one of `dir` and `configmap` (`namespace/name`).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ReplicaStateSection {
    pub(super) dir: Option<PathBuf>,
    pub(super) configmap: Option<String>,
    #[serde(default, with = "humantime_serde")]
    pub(super) ttl: Option<Duration>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct MemorySection {
    pub(super) dashboards: Option<ByteCount>,
    pub(super) route_tables: Option<ByteCount>,
    pub(super) partial_xds_requests: Option<ByteCount>,
    pub(super) xds_responses: Option<ByteCount>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct XdsSection {
    pub(super) listen: Option<SocketAddr>,
    pub(super) max_message_bytes: Option<ByteCount>,
    pub(super) max_connections: Option<usize>,
    pub(super) max_connections_per_peer: Option<usize>,
    pub(super) handshakes_per_peer_per_second: Option<usize>,
    pub(super) max_streams: Option<usize>,
    pub(super) tls: Option<TlsSection>,
}

/// `xds.tls`: all three files, or none.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct TlsSection {
    pub(super) cert: Option<PathBuf>,
    pub(super) key: Option<PathBuf>,
    pub(super) client_ca: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ProxiesSection {
    pub(super) networks: Option<Vec<ipnet::IpNet>>,
    pub(super) replica_ports: Option<ReplicaPortsSection>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ReplicaPortsSection {
    pub(super) http: Option<String>,
    pub(super) grpc: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct AdminSection {
    pub(super) listen: Option<SocketAddr>,
    pub(super) debug_listen: Option<SocketAddr>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct GatewaySection {
    #[serde(default)]
    pub(super) http_listener: ListenerSection,
    #[serde(default, with = "humantime_serde")]
    pub(super) upstream_idle_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub(super) connect_timeout: Option<Duration>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ListenerSection {
    pub(super) address: Option<IpAddr>,
    pub(super) port: Option<u16>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct SourceSection {
    pub(super) file: Option<FileSourceSection>,
    pub(super) kubernetes: Option<KubernetesSourceConfig>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileSourceSection {
    pub(super) path: PathBuf,
    #[serde(default, with = "humantime_serde")]
    pub(super) poll_interval: Option<Duration>,
}
