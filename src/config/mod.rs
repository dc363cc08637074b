//! Configuration: the `ray-xds` command line, its `RAY_XDS_*` environment variables and
//! the `ray-xds.yaml` config file, validated once into a typed [`Config`].
//!
//! Precedence: a flag or its environment variable beats the config file, which beats the
//! built-in default. A config file that cannot be read or parsed is an error naming the
//! file, the line and the field; nothing starts with a half-understood config.
//!
//! - `args`: the command line (clap), flags and their environment variables;
//! - `file`: the config file's shape, a struct per section;
//! - `load`: `Config::load`, one function per section, each putting the flags over the
//!   file and checking the result.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::policy::Policies;

mod args;
mod file;
mod load;

pub use args::{CheckArgs, Cli, Command, PolicyFlags, ServeArgs, StatusArgs, StatusOutput};
pub use load::{parse_yaml, MAX_CONFIG_FILE_BYTES};

/// The validated configuration the runtime runs with.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub xds_listen: SocketAddr,
    pub xds_max_message_bytes: usize,
    /// Connections the xDS listener holds (in total and per peer), and how long one may
    /// stay silent.
    pub xds_limits: crate::xds::listener::Limits,
    /// ADS streams served at once.
    pub xds_max_streams: usize,
    /// mTLS on the xDS listener (`None`: plain TCP).
    pub xds_tls: Option<crate::xds::tls::TlsFiles>,
    pub admin_listen: SocketAddr,
    /// Where `/debug/*` is served when not on `admin_listen`.
    pub admin_debug_listen: Option<SocketAddr>,
    /// The other replicas' admin addresses (`host:port`), asked for their switchovers.
    pub replica_peers: Vec<String>,
    /// How often they are asked.
    pub replica_poll_interval: Duration,
    /// Where this replica keeps its switchover view for a restart of every replica
    /// (`None`: nowhere; a restart then starts from the source and its peers).
    pub replica_state: Option<ReplicaStateConfig>,
    pub gateway: GatewaySettings,
    pub source: SourceConfig,
    /// Which proxy addresses may be published.
    pub addresses: crate::model::AddressPolicy,
    /// The global probe, dashboard, traffic and switchover policies; RayServices
    /// override parts of them.
    pub policies: Policies,
    /// What the bounded holdings may take in memory.
    pub memory: MemoryBudgets,
}

/// What each bounded holding may take, in (estimated) bytes: each is shared fairly
/// between its owners (`budget::FairBudget`). Real RSS runs at 2-4 times the estimate for
/// many small values; `runtime` warns at start when their sum cannot fit the container's
/// memory limit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemoryBudgets {
    /// The Ray dashboards' statuses, shared between clusters.
    pub dashboards: usize,
    /// The proxies' route tables, shared between clusters.
    pub route_tables: usize,
    /// xDS requests still arriving, shared between client addresses.
    pub partial_xds_requests: usize,
    /// ADS responses built and not yet written, shared between client addresses: real
    /// bytes, not an estimate, and held up to twice this (`xds::responses`).
    pub xds_responses: usize,
}

impl Default for MemoryBudgets {
    fn default() -> Self {
        MemoryBudgets {
            dashboards: DASHBOARDS_BUDGET_BYTES,
            route_tables: ROUTE_TABLES_BUDGET_BYTES,
            partial_xds_requests: crate::xds::codec::PARTIAL_REQUESTS_BUDGET_BYTES,
            xds_responses: crate::xds::responses::RESPONSE_BYTES_BOUND,
        }
    }
}

/// What the Ray dashboards' statuses may hold in all by default (`live::dashboards`).
pub(crate) const DASHBOARDS_BUDGET_BYTES: usize = 64 * 1024 * 1024;

/// What the proxies' route tables may hold in all by default (`live::route_tables`).
pub(crate) const ROUTE_TABLES_BUDGET_BYTES: usize = 32 * 1024 * 1024;

/// The range of every memory budget: 1 MiB to 16 GiB.
pub(crate) const MEMORY_BUDGET_RANGE: std::ops::RangeInclusive<usize> = (1 << 20)..=(16 << 30);

/// A range of ports, `MIN-MAX` (1 to 65535, MIN below MAX), as Ray's settings give them:
/// ports from MIN up to, not including, MAX.
pub(crate) fn parse_port_range(text: &str) -> Result<std::ops::RangeInclusive<u16>, String> {
    let bad = || format!("{text:?}: want MIN-MAX, ports 1 to 65535 (e.g. 30000-31000)");
    let (min, max) = text.trim().split_once('-').ok_or_else(bad)?;
    let port = |p: &str| p.trim().parse::<u16>().ok().filter(|p| *p > 0);
    match (port(min), port(max)) {
        (Some(min), Some(max)) if min < max => Ok(min..=max),
        _ => Err(bad()),
    }
}

/// A byte count: digits, optionally followed by a Kubernetes binary suffix (`Ki`, `Mi`,
/// `Gi`), e.g. `65536`, `64Mi`, `1Gi`.
pub(crate) fn parse_bytes(text: &str) -> Result<usize, String> {
    let text = text.trim();
    let (digits, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(at) => text.split_at(at),
        None => (text, ""),
    };
    let shift = match unit {
        "" => 0,
        "Ki" => 10,
        "Mi" => 20,
        "Gi" => 30,
        _ => {
            return Err(format!(
                "{text:?} is not a byte count: digits, then optionally Ki, Mi or Gi (e.g. 64Mi)"
            ))
        }
    };
    let n: usize = digits
        .parse()
        .map_err(|_| format!("{text:?} is not a byte count (e.g. 64Mi)"))?;
    n.checked_mul(1usize << shift)
        .ok_or_else(|| format!("{text:?} is too large"))
}

/// What `translate` needs to know about the Envoy it configures.
#[derive(Debug, Clone, PartialEq)]
pub struct GatewaySettings {
    pub listener_address: IpAddr,
    pub listener_port: u16,
    pub upstream_idle_timeout: Duration,
    pub connect_timeout: Duration,
}

impl Default for GatewaySettings {
    fn default() -> Self {
        GatewaySettings {
            listener_address: IpAddr::from([0, 0, 0, 0]),
            listener_port: 10000,
            upstream_idle_timeout: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(1),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum SourceConfig {
    File {
        path: PathBuf,
        poll_interval: Duration,
    },
    Kubernetes(KubernetesSourceConfig),
}

/// Where replicas keep their switchover views (`replicas.state`), and for how long an
/// entry counts after it was last written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaStateConfig {
    pub store: ReplicaStateStore,
    pub ttl: Duration,
}

/// The kind of store: a directory (one file per replica, any source) or one ConfigMap
/// of ray-xds's own namespace (one key per replica, the Kubernetes source's client).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplicaStateStore {
    Dir(PathBuf),
    ConfigMap { namespace: String, name: String },
}

/// Where and what the Kubernetes source watches.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesSourceConfig {
    /// Namespaces to watch; empty means all.
    #[serde(default)]
    pub namespaces: Vec<String>,
    /// Label selector on RayServices (`key=value,...`); empty means all.
    #[serde(default)]
    pub rayservice_selector: Option<String>,
    /// The API server's URL, for `kubectl proxy` or tests; by default the in-cluster
    /// service account, else `KUBECONFIG` / `~/.kube/config`.
    #[serde(default)]
    pub api_server: Option<String>,
    /// Hosts each namespace's RayServices may claim beyond `<name>.<namespace>` and
    /// `<name>.<namespace>.svc` (`ray-xds.io/hosts`): namespace → patterns (`name`,
    /// `*.suffix`, `prefix.*`, `*`). A claim outside them is refused.
    #[serde(default)]
    pub allowed_hosts: std::collections::BTreeMap<String, Vec<String>>,
}

impl KubernetesSourceConfig {
    /// The host policy (checked when the config was loaded).
    pub(crate) fn host_policy(&self) -> Result<crate::model::HostPolicy, String> {
        crate::model::HostPolicy::new(self.allowed_hosts.clone())
    }
}

/// The largest gRPC message accepted from an xDS client, by default (4 MiB).
pub(crate) const DEFAULT_XDS_MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;
/// What `xds.max_message_bytes` may be: 64 KiB to 64 MiB.
pub const XDS_MAX_MESSAGE_BYTES_RANGE: std::ops::RangeInclusive<usize> =
    64 * 1024..=64 * 1024 * 1024;

/// What `gateway.connect_timeout` may be: 1 ms to 60 s.
pub(crate) const CONNECT_TIMEOUT_RANGE: std::ops::RangeInclusive<Duration> =
    Duration::from_millis(1)..=Duration::from_secs(60);
/// What `source.file.poll_interval` may be: 10 ms to 1 h.
pub(crate) const FILE_POLL_INTERVAL_RANGE: std::ops::RangeInclusive<Duration> =
    Duration::from_millis(10)..=Duration::from_secs(3600);
/// At most this many `proxies.networks`.
pub(crate) const MAX_PROXY_NETWORKS: usize = 256;

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{file}: cannot read: {source}")]
    Read {
        file: PathBuf,
        source: std::io::Error,
    },
    #[error("{file}: {location}field `{field}`: {message}")]
    Parse {
        file: PathBuf,
        location: String,
        field: String,
        message: String,
    },
    #[error("{0}")]
    Invalid(String),
}

#[cfg(test)]
mod tests {
    use super::load::read_config_file;
    use super::*;
    use clap::Parser;
    use std::io::Write;

    fn write(text: &str) -> tempfile::NamedTempFile {
        let mut f = tempfile::Builder::new().suffix(".yaml").tempfile().unwrap();
        f.write_all(text.as_bytes()).unwrap();
        f
    }

    fn load(text: &str) -> Result<Config, ConfigError> {
        let f = write(text);
        Config::load(&ServeArgs {
            config: Some(f.path().to_path_buf()),
            ..Default::default()
        })
    }

    /// Listeners that would share a port, and an API server that is no URL, are refused
    /// when the config is loaded (so `check` refuses them), not when `serve` binds or
    /// connects.
    #[test]
    fn listeners_sharing_a_port_and_a_bad_api_server_are_refused_at_load() {
        let source = "source:\n  file: { path: services.yaml }\n";
        for (listeners, names) in [
            (
                "xds: { listen: 127.0.0.1:19000 }\n",
                "xds.listen (127.0.0.1:19000) and admin.listen",
            ),
            (
                "xds: { listen: 0.0.0.0:18000 }\nadmin: { listen: 127.0.0.1:18000 }\n",
                "xds.listen (0.0.0.0:18000) and admin.listen (127.0.0.1:18000)",
            ),
            (
                "admin: { listen: 127.0.0.1:19000, debug_listen: 127.0.0.1:18000 }\n",
                "xds.listen (127.0.0.1:18000) and admin.debug_listen",
            ),
        ] {
            let err = load(&format!("{listeners}{source}"))
                .unwrap_err()
                .to_string();
            assert!(err.contains(names) && err.contains("share a port"), "{err}");
        }
        // Different addresses on one port, and port 0 (any free port), are fine.
        for ok in [
            "xds: { listen: 127.0.0.1:18000 }\nadmin: { listen: 127.0.0.2:18000 }\n",
            "xds: { listen: 127.0.0.1:0 }\nadmin: { listen: 127.0.0.1:0 }\n",
        ] {
            load(&format!("{ok}{source}")).unwrap();
        }
        for bad in ["not a url", "ftp://host", "http://", "/just/a/path"] {
            let err = load(&format!(
                "source:\n  kubernetes: {{ api_server: {bad:?} }}\n"
            ))
            .unwrap_err()
            .to_string();
            assert!(err.contains("source.kubernetes.api_server"), "{bad}: {err}");
        }
        load("source:\n  kubernetes: { api_server: \"http://127.0.0.1:8001\" }\n").unwrap();
    }

    #[test]
    fn xds_tls_takes_all_three_files_relative_to_the_config_file() {
        let f = write(
            "xds:\n  tls: { cert: tls/tls.crt, key: tls/tls.key, client_ca: /abs/ca.crt }\nsource: { kubernetes: {} }\n",
        );
        let c = Config::load(&ServeArgs {
            config: Some(f.path().to_path_buf()),
            ..Default::default()
        })
        .unwrap();
        let tls = c.xds_tls.expect("tls on");
        let dir = f.path().parent().unwrap();
        assert_eq!(tls.cert, dir.join("tls/tls.crt"));
        assert_eq!(tls.key, dir.join("tls/tls.key"));
        assert_eq!(tls.client_ca, PathBuf::from("/abs/ca.crt"));
        // A flag wins over the file, field by field.
        let c = Config::load(&ServeArgs {
            config: Some(f.path().to_path_buf()),
            xds_tls_key: Some("/flag/key.pem".into()),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(c.xds_tls.unwrap().key, PathBuf::from("/flag/key.pem"));
        // Off by default.
        assert_eq!(load("source: { kubernetes: {} }\n").unwrap().xds_tls, None);
    }

    #[test]
    fn xds_tls_without_a_client_ca_is_refused() {
        let e = load("xds:\n  tls: { cert: a.crt, key: a.key }\nsource: { kubernetes: {} }\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("missing: client_ca (--xds-tls-client-ca)"),
            "{e}"
        );
        let e = Config::load(&ServeArgs {
            source_kubernetes: true,
            xds_tls_cert: Some("a.crt".into()),
            ..Default::default()
        })
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("missing: key (--xds-tls-key), client_ca (--xds-tls-client-ca)"),
            "{e}"
        );
        let e = load(
            "xds:\n  tls: { cert: a, key: b, client_ca: c, ca: d }\nsource: { kubernetes: {} }\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("xds.tls") && e.contains("unknown field `ca`"),
            "{e}"
        );
    }

    #[test]
    fn allowed_hosts_are_read_and_checked() {
        let c = load("source:\n  kubernetes:\n    allowed_hosts:\n      team-a: ['*.team-a.example.com', api.example.com]\n      edge: ['*']\n").unwrap();
        let SourceConfig::Kubernetes(k) = &c.source else {
            panic!()
        };
        let policy = k.host_policy().unwrap();
        assert!(policy.allows("team-a", "llm", "x.team-a.example.com"));
        assert!(policy.allows("edge", "gw", "*"));
        assert!(!policy.allows("team-b", "llm", "x.team-a.example.com"));
        let e = load("source:\n  kubernetes:\n    allowed_hosts:\n      team-a: ['*.*']\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("source.kubernetes.allowed_hosts: namespace team-a: host \"*.*\""),
            "{e}"
        );
        let e = load("source:\n  kubernetes:\n    allowed_hosts: { team-a: x.example }\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("allowed_hosts"), "{e}");
    }

    #[test]
    fn replica_peers_are_host_port_pairs() {
        let c = load("replicas: { peers: ['ray-xds-peers.ray-xds.svc:19000', '10.0.0.2:19000'], poll_interval: 1s }\nsource: { kubernetes: {} }\n").unwrap();
        assert_eq!(
            c.replica_peers,
            ["ray-xds-peers.ray-xds.svc:19000", "10.0.0.2:19000"]
        );
        assert_eq!(c.replica_poll_interval, Duration::from_secs(1));
        let none = load("source: { kubernetes: {} }\n").unwrap();
        assert!(none.replica_peers.is_empty());
        assert_eq!(none.replica_poll_interval, Duration::from_millis(500));
        for bad in [
            "peers: [nohost]",
            "peers: [':19000']",
            "peers: ['h:0']",
            "peers: ['h:99999']",
            "poll_interval: 1ms",
        ] {
            let e = load(&format!(
                "replicas: {{ {bad} }}\nsource: {{ kubernetes: {{}} }}\n"
            ))
            .unwrap_err()
            .to_string();
            assert!(e.contains("replicas."), "{bad}: {e}");
        }
    }

    #[test]
    fn replica_state_is_a_directory_or_a_configmap_of_the_kubernetes_source() {
        let k8s = "source: { kubernetes: {} }\n";
        let c = load(&format!(
            "replicas: {{ state: {{ configmap: ray-xds/ray-xds-state, ttl: 30m }} }}\n{k8s}"
        ))
        .unwrap();
        assert_eq!(
            c.replica_state,
            Some(ReplicaStateConfig {
                store: ReplicaStateStore::ConfigMap {
                    namespace: "ray-xds".into(),
                    name: "ray-xds-state".into(),
                },
                ttl: Duration::from_secs(1800),
            })
        );
        let c = load(&format!(
            "replicas: {{ state: {{ dir: /var/lib/ray-xds }} }}\n{k8s}"
        ))
        .unwrap();
        assert_eq!(
            c.replica_state.map(|s| (s.store, s.ttl)),
            Some((
                ReplicaStateStore::Dir("/var/lib/ray-xds".into()),
                Duration::from_secs(900)
            ))
        );
        assert_eq!(load(k8s).unwrap().replica_state, None);
        for (bad, why) in [
            ("state: { configmap: ray-xds-state }", "not namespace/name"),
            ("state: { configmap: Ray/x }", "not namespace/name"),
            (
                "state: { configmap: a/b, dir: /x }",
                "either dir or configmap",
            ),
            ("state: { dir: '' }", "empty"),
            ("state: { dir: /x, ttl: 5s }", "1m..=24h"),
            ("state: { dir: /x, ttl: 48h }", "1m..=24h"),
            ("state: { dri: /x }", "unknown field"),
        ] {
            let e = load(&format!("replicas: {{ {bad} }}\n{k8s}"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(why), "{bad}: {e}");
        }
        // A ConfigMap needs the Kubernetes source's client.
        let dir = tempfile::tempdir().unwrap();
        let services = dir.path().join("services.yaml");
        std::fs::write(&services, "rayservices: []\n").unwrap();
        let config = dir.path().join("ray-xds.yaml");
        std::fs::write(
            &config,
            format!(
                "replicas: {{ state: {{ configmap: a/b }} }}\nsource: {{ file: {{ path: {} }} }}\n",
                services.display()
            ),
        )
        .unwrap();
        let e = Config::load(&ServeArgs {
            config: Some(config),
            ..Default::default()
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("needs the Kubernetes source"), "{e}");
    }

    #[test]
    fn debug_pages_may_have_a_listener_of_their_own() {
        let c = load("admin: { listen: 0.0.0.0:19000, debug_listen: 127.0.0.1:19001 }\nsource: { kubernetes: {} }\n")
            .unwrap();
        assert_eq!(
            c.admin_debug_listen,
            Some("127.0.0.1:19001".parse().unwrap())
        );
        assert_eq!(
            load("source: { kubernetes: {} }\n")
                .unwrap()
                .admin_debug_listen,
            None
        );
        let e = load("admin: { listen: 127.0.0.1:19000, debug_listen: 127.0.0.1:19000 }\nsource: { kubernetes: {} }\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("admin.debug_listen"), "{e}");
    }

    #[test]
    fn reads_the_documented_shape() {
        let c = load(
            "xds:   { listen: 127.0.0.1:18001 }\nadmin: { listen: 127.0.0.1:19001 }\ngateway:\n  http_listener: { address: 0.0.0.0, port: 10001 }\nsource:\n  file: { path: services.yaml }\n",
        )
        .unwrap();
        assert_eq!(c.xds_listen, "127.0.0.1:18001".parse().unwrap());
        assert_eq!(c.admin_listen, "127.0.0.1:19001".parse().unwrap());
        assert_eq!(c.gateway.listener_port, 10001);
        assert_eq!(c.gateway.upstream_idle_timeout, Duration::from_secs(60));
        let SourceConfig::File { path, .. } = &c.source else {
            panic!("a file source: {:?}", c.source)
        };
        assert!(path.ends_with("services.yaml"));
        assert!(
            path.is_absolute(),
            "relative to the config file's folder: {path:?}"
        );
    }

    #[test]
    fn flags_beat_the_file() {
        let f = write("xds: { listen: 127.0.0.1:18001 }\nsource: { file: { path: a.yaml } }\n");
        let c = Config::load(&ServeArgs {
            config: Some(f.path().to_path_buf()),
            xds_listen: Some("127.0.0.1:1".parse().unwrap()),
            source_file: Some("b.yaml".into()),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(c.xds_listen.port(), 1);
        assert_eq!(
            c.source,
            SourceConfig::File {
                path: "b.yaml".into(),
                poll_interval: Duration::from_secs(1)
            }
        );
    }

    #[test]
    fn a_bad_value_names_file_line_and_field() {
        let err = load("xds:\n  listen: not-an-address\nsource: { file: { path: a.yaml } }\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(".yaml: line 2, column 11: field `xds.listen`"),
            "{err}"
        );
        assert!(err.contains("invalid socket address"), "{err}");
    }

    #[test]
    fn an_unknown_field_is_named() {
        let err = load("gateway:\n  http_listener: { port: 1, adress: 0.0.0.0 }\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("line 2"), "{err}");
        assert!(err.contains("gateway.http_listener.adress"), "{err}");
        assert!(err.contains("unknown field `adress`"), "{err}");
    }

    #[test]
    fn traffic_policy() {
        let c = load("traffic: { retries: 5, idempotent: true, max_ejection_percent: 30 }\nsource: { file: { path: a.yaml } }\n").unwrap();
        assert_eq!(c.policies.traffic.retries, 5);
        assert!(c.policies.traffic.idempotent);
        assert_eq!(c.policies.traffic.max_ejection_percent, 30);
        assert_eq!(c.policies.traffic.per_try_timeout, Duration::from_secs(10));
        assert!(load(
            "traffic: { max_ejection_percent: 101 }\nsource: { file: { path: a.yaml } }\n"
        )
        .is_err());
        let err = load("traffic: { retrys: 1 }\n").unwrap_err().to_string();
        assert!(err.contains("traffic.retrys"), "{err}");
    }

    #[test]
    fn kubernetes_source() {
        let c = load(
            "source:\n  kubernetes:\n    namespaces: [ml, serving]\n    rayservice_selector: team=ml\n",
        )
        .unwrap();
        assert_eq!(
            c.source,
            SourceConfig::Kubernetes(KubernetesSourceConfig {
                namespaces: vec!["ml".into(), "serving".into()],
                rayservice_selector: Some("team=ml".into()),
                api_server: None,
                allowed_hosts: Default::default(),
            })
        );
        let c = load("source: { kubernetes: {} }\n").unwrap();
        assert_eq!(c.source, SourceConfig::Kubernetes(Default::default()));
        let both = load("source: { kubernetes: {}, file: { path: s.yaml } }\n");
        assert!(both.unwrap_err().to_string().contains("not both"));
        let typo = load("source: { kubernetes: { namespace: [ml] } }\n");
        assert!(typo
            .unwrap_err()
            .to_string()
            .contains("source.kubernetes.namespace"));
        let flag = Config::load(&ServeArgs {
            source_kubernetes: true,
            ..Default::default()
        })
        .unwrap();
        assert_eq!(flag.source, SourceConfig::Kubernetes(Default::default()));
    }

    #[test]
    fn global_switchover_policy() {
        let c = load(
            "source: { file: { path: s.yaml } }\nswitchover: { mode: progressive, steps: [30, 100], interval: 2s, drain_grace: 5s, warm_timeout: 3s }\n",
        )
        .unwrap();
        assert_eq!(
            c.policies.switchover.shift(),
            crate::policy::switchover::ShiftMode::Progressive {
                steps: vec![30, 100],
                interval: Duration::from_secs(2)
            }
        );
        assert_eq!(c.policies.switchover.drain_grace, Duration::from_secs(5));
        assert_eq!(c.policies.switchover.warm_timeout, Duration::from_secs(3));
        assert_eq!(c.policies.switchover.min_ready_proxies, 1);
        let err = load("source: { file: { path: s.yaml } }\nswitchover: { steps: [50] }\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("must rise from above 0 to 100"), "{err}");
        let err = load("source: { file: { path: s.yaml } }\nswitchover: { mode: sideways }\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("switchover.mode"), "{err}");
    }

    #[test]
    fn probe_and_dashboard_settings() {
        let c = load("probe: { interval: 1s, unhealthy_threshold: 3 }\ndashboard: { poll_interval: 5s }\nsource: { file: { path: a.yaml } }\n").unwrap();
        assert_eq!(c.policies.probe.interval, Duration::from_secs(1));
        assert_eq!(c.policies.probe.unhealthy_threshold, 3);
        assert_eq!(c.policies.probe.timeout, Duration::from_millis(300));
        assert_eq!(c.policies.dashboard.poll_interval, Duration::from_secs(5));
        assert!(
            load("probe: { healthy_threshold: 0 }\nsource: { file: { path: a.yaml } }\n").is_err()
        );
    }

    #[test]
    fn rejects_idle_timeout_at_or_above_ray_keepalive() {
        let err =
            load("gateway: { upstream_idle_timeout: 90s }\nsource: { file: { path: a.yaml } }\n")
                .unwrap_err()
                .to_string();
        assert!(err.contains("upstream_idle_timeout"), "{err}");
        let err = load("gateway: { upstream_idle_timeout: soon }\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("gateway.upstream_idle_timeout"), "{err}");
    }

    #[test]
    fn a_gateway_listener_needs_a_unicast_address() {
        for (yaml, field) in [
            ("address: 255.255.255.255", "gateway.http_listener.address"),
            ("address: 224.0.0.1", "gateway.http_listener.address"),
        ] {
            let err = load(&format!(
                "gateway: {{ http_listener: {{ {yaml} }} }}\nsource: {{ file: {{ path: a.yaml }} }}\n"
            ))
            .unwrap_err()
            .to_string();
            assert!(err.contains(field), "{err}");
        }
    }

    #[test]
    fn a_config_file_over_the_cap_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ray-xds.yaml");
        let mut text = String::from("source: { file: { path: a.yaml } }\n");
        text += &"# padding\n".repeat(120_000);
        std::fs::write(&path, text).unwrap();
        let err = read_config_file(&path).unwrap_err().to_string();
        assert!(err.contains("over 1 MiB"), "{err}");
    }

    /// Envoy reads these in whole milliseconds: `1ns` would be published as 0 (no idle
    /// timeout at all), `1500us` as 1 ms.
    #[test]
    fn gateway_durations_are_whole_milliseconds() {
        for (yaml, field) in [
            (
                "upstream_idle_timeout: 1ns",
                "gateway.upstream_idle_timeout",
            ),
            ("connect_timeout: 1500us", "gateway.connect_timeout"),
        ] {
            let err = load(&format!(
                "gateway: {{ {yaml} }}\nsource: {{ file: {{ path: a.yaml }} }}\n"
            ))
            .unwrap_err()
            .to_string();
            assert!(
                err.contains(field) && err.contains("whole number of milliseconds"),
                "{err}"
            );
        }
    }

    #[test]
    fn replica_ports_from_file_and_flag() {
        let c = load("source: { file: { path: a.yaml } }\n").unwrap();
        assert_eq!(
            c.addresses.replica_ports,
            crate::model::ReplicaPorts::default()
        );
        let c = load("proxies: { replica_ports: { http: 31000-31999 } }\nsource: { file: { path: a.yaml } }\n").unwrap();
        assert_eq!(c.addresses.replica_ports.http, 31000..=31999);
        assert_eq!(c.addresses.replica_ports.grpc, 40000..=41000);
        for bad in ["31999-31000", "31000-31000", "0-5", "x", "30000", "1-70000"] {
            let err = load(&format!(
                "proxies: {{ replica_ports: {{ grpc: \"{bad}\" }} }}\nsource: {{ file: {{ path: a.yaml }} }}\n"
            ))
            .unwrap_err()
            .to_string();
            assert!(err.contains("proxies.replica_ports.grpc"), "{bad}: {err}");
        }
        let cli = Cli::try_parse_from([
            "ray-xds",
            "serve",
            "--source-file",
            "a.yaml",
            "--replica-grpc-ports",
            "50000-50010",
        ])
        .unwrap();
        let Command::Serve(args) = cli.command else {
            panic!("not serve")
        };
        assert_eq!(
            Config::load(&args).unwrap().addresses.replica_ports.grpc,
            50000..=50010
        );
        assert!(Cli::try_parse_from(["ray-xds", "serve", "--replica-http-ports", "9-1"]).is_err());
    }

    #[test]
    fn proxy_networks_from_file_and_flag() {
        let c = load("proxies: { networks: [10.0.0.0/8, \"fd00::/8\", 10.1.2.3/16] }\nsource: { file: { path: a.yaml } }\n").unwrap();
        assert_eq!(
            c.addresses.networks,
            ["10.0.0.0/8", "fd00::/8", "10.1.0.0/16"].map(|n| n.parse::<ipnet::IpNet>().unwrap())
        );
        assert!(load("source: { file: { path: a.yaml } }\n")
            .unwrap()
            .addresses
            .networks
            .is_empty());
        let err =
            load("proxies: { networks: [10.0.0.0/33] }\nsource: { file: { path: a.yaml } }\n")
                .unwrap_err()
                .to_string();
        assert!(err.contains("proxies.networks"), "{err}");
        let cli = Cli::try_parse_from([
            "ray-xds",
            "serve",
            "--source-file",
            "a.yaml",
            "--proxy-networks",
            "10.0.0.0/8,192.0.2.0/24",
        ])
        .unwrap();
        let Command::Serve(args) = cli.command else {
            panic!("not serve")
        };
        assert_eq!(Config::load(&args).unwrap().addresses.networks.len(), 2);
        assert!(Cli::try_parse_from([
            "ray-xds",
            "serve",
            "--proxy-networks",
            "10.0.0.0/8,nonsense"
        ])
        .is_err());
    }

    #[test]
    fn gateway_and_file_durations_are_bounded() {
        for (field, bad) in [
            (
                "gateway: { connect_timeout: 0s }",
                "gateway.connect_timeout",
            ),
            (
                "gateway: { connect_timeout: 18446744073709551615s }",
                "gateway.connect_timeout",
            ),
            (
                "gateway: { connect_timeout: 61s }",
                "gateway.connect_timeout",
            ),
        ] {
            let err = load(&format!(
                "{field}\nsource: {{ file: {{ path: a.yaml }} }}\n"
            ))
            .unwrap_err()
            .to_string();
            assert!(err.contains(bad), "{field}: {err}");
        }
        for bad in ["0s", "1ms", "2h", "18446744073709551615s"] {
            let err = load(&format!(
                "source: {{ file: {{ path: a.yaml, poll_interval: {bad} }} }}\n"
            ))
            .unwrap_err()
            .to_string();
            assert!(err.contains("source.file.poll_interval"), "{bad}: {err}");
        }
        assert!(load("gateway: { connect_timeout: 60s }\nsource: { file: { path: a.yaml, poll_interval: 10ms } }\n").is_ok());
    }

    #[test]
    fn xds_connection_and_stream_limits_are_bounded() {
        let c = load("xds: { max_connections: 10, max_connections_per_peer: 3, max_streams: 50, handshakes_per_peer_per_second: 0 }\nsource: { file: { path: a.yaml } }\n").unwrap();
        assert_eq!(c.xds_limits.handshakes_per_peer_per_second, 0);
        assert_eq!(c.xds_limits.max_connections, 10);
        assert_eq!(c.xds_limits.max_connections_per_peer, 3);
        assert_eq!(c.xds_max_streams, 50);
        for (field, bad) in [
            ("max_connections", "0"),
            ("max_connections", "65537"),
            ("max_connections_per_peer", "0"),
            ("handshakes_per_peer_per_second", "100001"),
            ("handshakes_per_peer_per_second", "-1"),
            ("max_streams", "0"),
            ("max_streams", "18446744073709551615"),
        ] {
            let err = load(&format!(
                "xds: {{ {field}: {bad} }}\nsource: {{ file: {{ path: a.yaml }} }}\n"
            ))
            .unwrap_err()
            .to_string();
            assert!(
                err.contains(&format!("xds.{field}")),
                "{field}={bad}: {err}"
            );
        }
    }

    /// The memory budgets are settings (file, flag, environment), bounded, in
    /// bytes or with a Kubernetes binary suffix.
    #[test]
    fn memory_budgets_are_bounded_settings() {
        use clap::Parser;
        assert_eq!(parse_bytes("65536"), Ok(65_536));
        assert_eq!(parse_bytes("64Ki"), Ok(64 << 10));
        assert_eq!(parse_bytes(" 64Mi "), Ok(64 << 20));
        assert_eq!(parse_bytes("2Gi"), Ok(2 << 30));
        for bad in [
            "",
            "Mi",
            "64MB",
            "64 Mi",
            "-1",
            "1.5Gi",
            "18446744073709551615Gi",
        ] {
            assert!(parse_bytes(bad).is_err(), "{bad:?}");
        }
        let c = load("source: { file: { path: a.yaml } }\n").unwrap();
        assert_eq!(c.memory, MemoryBudgets::default());
        assert_eq!(c.memory.dashboards, 64 << 20);
        let c = load("memory: { dashboards: 128Mi, route_tables: 8388608, partial_xds_requests: 1Gi, xds_responses: 2Mi }\nsource: { file: { path: a.yaml } }\n").unwrap();
        assert_eq!(
            c.memory,
            MemoryBudgets {
                dashboards: 128 << 20,
                route_tables: 8 << 20,
                partial_xds_requests: 1 << 30,
                xds_responses: 2 << 20,
            }
        );
        for (field, bad) in [
            ("dashboards", "0"),
            ("dashboards", "1023Ki"),
            ("route_tables", "17Gi"),
            ("route_tables", "18446744073709551615"),
            ("partial_xds_requests", "1Mi"), // under twice the 4 MiB message
            ("xds_responses", "1023Ki"),
            ("xds_responses", "17Gi"),
            ("dashboards", "lots"),
            ("dashboards", "1.5"),
            ("dashboards", "-1"),
            ("dashboards", "true"),
            ("dashboards", "[1Mi]"),
            ("dashboards", "18446744073709551616"),
        ] {
            let err = load(&format!(
                "memory: {{ {field}: {bad} }}\nsource: {{ file: {{ path: a.yaml }} }}\n"
            ))
            .unwrap_err()
            .to_string();
            assert!(err.contains(field), "{field}={bad}: {err}");
            assert!(!err.contains("untagged"), "{field}={bad}: {err}");
        }
        // A flag beats the file, and is read by the same rule.
        let f = write("memory: { route_tables: 8Mi }\nsource: { file: { path: a.yaml } }\n");
        let cli = Cli::try_parse_from([
            "ray-xds",
            "serve",
            "-c",
            f.path().to_str().unwrap(),
            "--memory-route-tables",
            "16Mi",
        ])
        .unwrap();
        let Command::Serve(args) = cli.command else {
            panic!("not serve")
        };
        assert_eq!(Config::load(&args).unwrap().memory.route_tables, 16 << 20);
        let err =
            Cli::try_parse_from(["ray-xds", "serve", "--memory-dashboards", "64MB"]).unwrap_err();
        assert!(err.to_string().contains("--memory-dashboards"), "{err}");
    }

    #[test]
    fn the_largest_xds_message_is_bounded() {
        for bad in ["0", "65535", "67108865", "18446744073709551615"] {
            let err = load(&format!(
                "xds: {{ max_message_bytes: {bad} }}\nsource: {{ file: {{ path: a.yaml }} }}\n"
            ))
            .unwrap_err()
            .to_string();
            assert!(err.contains("xds.max_message_bytes"), "{bad}: {err}");
        }
        assert!(
            load("xds: { max_message_bytes: 65536 }\nsource: { file: { path: a.yaml } }\n").is_ok()
        );
        // With a suffix too; past 32 MiB the partial requests' default budget grows to
        // hold two of them, and an explicit one too small is refused.
        let c =
            load("xds: { max_message_bytes: 64Mi }\nsource: { file: { path: a.yaml } }\n").unwrap();
        assert_eq!(c.xds_max_message_bytes, 64 << 20);
        assert_eq!(c.memory.partial_xds_requests, 128 << 20);
        let err = load("xds: { max_message_bytes: 64Mi }\nmemory: { partial_xds_requests: 64Mi }\nsource: { file: { path: a.yaml } }\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("at least twice"), "{err}");
    }

    #[test]
    fn a_missing_file_and_a_missing_source_are_errors() {
        let err = Config::load(&ServeArgs {
            config: Some("/nonexistent/ray-xds.yaml".into()),
            ..Default::default()
        })
        .unwrap_err()
        .to_string();
        assert!(
            err.starts_with("/nonexistent/ray-xds.yaml: cannot read"),
            "{err}"
        );
        assert!(load("xds: {}\n")
            .unwrap_err()
            .to_string()
            .contains("no source configured"));
    }

    #[test]
    fn cli_help_documents_every_flag_and_its_env() {
        use clap::CommandFactory;
        let mut cmd = Cli::command();
        let serve = cmd.find_subcommand_mut("serve").unwrap();
        let help = serve.render_long_help().to_string();
        for env in [
            "RAY_XDS_CONFIG",
            "RAY_XDS_XDS_LISTEN",
            "RAY_XDS_ADMIN_LISTEN",
            "RAY_XDS_GATEWAY_ADDRESS",
            "RAY_XDS_GATEWAY_PORT",
            "RAY_XDS_UPSTREAM_IDLE_TIMEOUT",
            "RAY_XDS_SOURCE_FILE",
        ] {
            assert!(help.contains(env), "{env} missing from --help");
        }
        for field in crate::policy::all_fields() {
            assert!(
                help.contains(&format!("--{}", field.flag)),
                "--{}",
                field.flag
            );
            assert!(help.contains(&field.env()), "{}", field.env());
        }
    }

    #[test]
    fn a_policy_flag_beats_the_file_and_is_checked_by_its_rule() {
        use clap::Parser;
        let f = write("traffic: { retries: 5 }\nprobe: { timeout: 100ms }\nsource: { file: { path: a.yaml } }\n");
        let path = f.path().to_str().unwrap();
        let cli = Cli::try_parse_from([
            "ray-xds",
            "serve",
            "-c",
            path,
            "--retries",
            "2",
            "--switchover-steps",
            "50,100",
        ])
        .unwrap();
        let Command::Serve(args) = cli.command else {
            panic!("not serve")
        };
        let c = Config::load(&args).unwrap();
        assert_eq!(c.policies.traffic.retries, 2);
        assert_eq!(c.policies.probe.timeout, Duration::from_millis(100));
        assert_eq!(
            c.policies.switchover.shift(),
            crate::policy::switchover::ShiftMode::Progressive {
                steps: vec![50, 100],
                interval: Duration::from_secs(10)
            }
        );
        for bad in [
            ["--base-ejection-time", "0s"],
            ["--probe-max-concurrent", "18446744073709551615"],
            ["--max-ejection-percent", "150"],
            ["--switchover-steps", "50,90"],
        ] {
            let err = Cli::try_parse_from(["ray-xds", "serve", bad[0], bad[1]]).unwrap_err();
            assert!(err.to_string().contains(bad[0]), "{err}");
        }
    }
}
