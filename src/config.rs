//! Configuration: the `ray-xds` command line, its `RAY_XDS_*` environment variables and
//! the `ray-xds.yaml` config file, validated once into a typed [`Config`].
//!
//! Precedence: a flag or its environment variable beats the config file, which beats the
//! built-in default. A config file that cannot be read or parsed is an error naming the
//! file, the line and the field; nothing starts with a half-understood config.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::policy::{dashboard, probe, switchover, traffic, GlobalOverrides, Policies};
use serde::Deserialize;

/// An xDS control plane that keeps Envoy in front of Ray Serve routing around dying Ray nodes.
#[derive(Debug, Parser)]
#[command(name = "ray-xds", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the control plane: watch the source, serve ADS to Envoy, serve the admin API.
    Serve(ServeArgs),
}

/// Flags of `ray-xds serve`. Each overrides the matching config-file field.
#[derive(Debug, Args, Default, Clone)]
pub struct ServeArgs {
    /// Config file (YAML). Relative paths inside it are relative to the file's folder.
    #[arg(long, short = 'c', env = "RAY_XDS_CONFIG")]
    pub config: Option<PathBuf>,

    /// Address the xDS (ADS gRPC) server listens on [config: xds.listen; default 127.0.0.1:18000].
    #[arg(long, env = "RAY_XDS_XDS_LISTEN")]
    pub xds_listen: Option<SocketAddr>,

    /// Address the admin HTTP server (/healthz, /readyz, /metrics, /debug/*) listens on
    /// [config: admin.listen; default 127.0.0.1:19000].
    #[arg(long, env = "RAY_XDS_ADMIN_LISTEN")]
    pub admin_listen: Option<SocketAddr>,

    /// Serve /debug/* on this address only, not on the admin address (e.g. loopback, for
    /// `kubectl port-forward`) [config: admin.debug_listen; default: on admin.listen].
    #[arg(long, env = "RAY_XDS_ADMIN_DEBUG_LISTEN")]
    pub admin_debug_listen: Option<SocketAddr>,

    /// The other replicas' admin addresses (`host:port`, comma-separated; a name is
    /// resolved at each poll and every address asked, e.g. a headless Service), whose
    /// switchover views this replica follows [config: replicas.peers; default none].
    #[arg(long, env = "RAY_XDS_REPLICA_PEERS", value_delimiter = ',')]
    pub replica_peers: Option<Vec<String>>,

    /// PEM certificate chain the xDS listener presents. With --xds-tls-key and
    /// --xds-tls-client-ca it turns on mTLS: only clients with a certificate signed by
    /// a client CA connect [config: xds.tls.cert; default: plain TCP].
    #[arg(long, env = "RAY_XDS_XDS_TLS_CERT")]
    pub xds_tls_cert: Option<PathBuf>,

    /// PEM private key of --xds-tls-cert (PKCS#8, PKCS#1 or SEC1) [config: xds.tls.key].
    #[arg(long, env = "RAY_XDS_XDS_TLS_KEY")]
    pub xds_tls_key: Option<PathBuf>,

    /// PEM certificates of the CAs whose client certificates may connect to the xDS
    /// listener [config: xds.tls.client_ca].
    #[arg(long, env = "RAY_XDS_XDS_TLS_CLIENT_CA")]
    pub xds_tls_client_ca: Option<PathBuf>,

    /// IP address of the Envoy HTTP listener that ray-xds configures
    /// [config: gateway.http_listener.address; default 0.0.0.0].
    #[arg(long, env = "RAY_XDS_GATEWAY_ADDRESS")]
    pub gateway_address: Option<IpAddr>,

    /// Port of the Envoy HTTP listener that ray-xds configures
    /// [config: gateway.http_listener.port; default 10000].
    #[arg(long, env = "RAY_XDS_GATEWAY_PORT")]
    pub gateway_port: Option<u16>,

    /// How long Envoy keeps an idle upstream connection to a Ray proxy. Must stay below
    /// Ray Serve's keep-alive (90 s in Ray 2.60)
    /// [config: gateway.upstream_idle_timeout; default 60s].
    #[arg(long, env = "RAY_XDS_UPSTREAM_IDLE_TIMEOUT", value_parser = humantime::parse_duration)]
    pub upstream_idle_timeout: Option<Duration>,

    /// Connect timeout from Envoy to a Ray proxy [config: gateway.connect_timeout; default 1s].
    #[arg(long, env = "RAY_XDS_CONNECT_TIMEOUT", value_parser = humantime::parse_duration)]
    pub connect_timeout: Option<Duration>,

    /// services.yaml of the file source [config: source.file.path].
    #[arg(long, env = "RAY_XDS_SOURCE_FILE")]
    pub source_file: Option<PathBuf>,

    /// Watch RayServices and pods in Kubernetes (all namespaces, in-cluster credentials or
    /// KUBECONFIG) instead of a file [config: source.kubernetes].
    #[arg(long, env = "RAY_XDS_SOURCE_KUBERNETES")]
    pub source_kubernetes: bool,

    /// How often the file source re-reads its file even without a change notification
    /// [config: source.file.poll_interval; default 1s].
    #[arg(long, env = "RAY_XDS_SOURCE_FILE_POLL_INTERVAL", value_parser = humantime::parse_duration)]
    pub source_file_poll_interval: Option<Duration>,

    /// Largest gRPC message accepted from an xDS client; bytes, or with a Ki/Mi suffix
    /// [config: xds.max_message_bytes; default 4Mi; 64Ki..=64Mi].
    #[arg(long, env = "RAY_XDS_XDS_MAX_MESSAGE_BYTES", value_parser = parse_bytes)]
    pub xds_max_message_bytes: Option<usize>,

    /// Connections the xDS listener holds at once [config: xds.max_connections;
    /// default 4096; 1..=65536].
    #[arg(long, env = "RAY_XDS_XDS_MAX_CONNECTIONS")]
    pub xds_max_connections: Option<usize>,

    /// Connections the xDS listener holds from one IP address
    /// [config: xds.max_connections_per_peer; default 256; 1..=65536].
    #[arg(long, env = "RAY_XDS_XDS_MAX_CONNECTIONS_PER_PEER")]
    pub xds_max_connections_per_peer: Option<usize>,

    /// ADS streams served at once over all connections (at most 100 per connection)
    /// [config: xds.max_streams; default 20000; 1..=1000000].
    #[arg(long, env = "RAY_XDS_XDS_MAX_STREAMS")]
    pub xds_max_streams: Option<usize>,

    /// Networks every published proxy must be in, comma-separated CIDRs (e.g.
    /// `10.0.0.0/8,fd00::/8`). Unset: proxies the source lists are trusted (but a
    /// hostNetwork pod's, its node's address, is refused), and proxies discovered from a
    /// dashboard must be in its /16 (IPv4) or /64 (IPv6) [config: proxies.networks].
    #[arg(long, env = "RAY_XDS_PROXY_NETWORKS", value_delimiter = ',')]
    pub proxy_networks: Option<Vec<ipnet::IpNet>>,

    /// The ports Ray's direct ingress gives ingress replicas for HTTP, `MIN-MAX` (Ray's
    /// `RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT`/`_MAX_`): a replica a dashboard lists
    /// elsewhere is refused [config: proxies.replica_ports.http; default 30000-31000].
    #[arg(long, env = "RAY_XDS_REPLICA_HTTP_PORTS", value_parser = parse_port_range)]
    pub replica_http_ports: Option<std::ops::RangeInclusive<u16>>,

    /// The same for gRPC (`RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT`/`_MAX_`) [config:
    /// proxies.replica_ports.grpc; default 40000-41000].
    #[arg(long, env = "RAY_XDS_REPLICA_GRPC_PORTS", value_parser = parse_port_range)]
    pub replica_grpc_ports: Option<std::ops::RangeInclusive<u16>>,

    /// Memory (estimated) the Ray dashboards' statuses may hold in all, shared fairly
    /// between clusters; bytes, or with a Ki/Mi/Gi suffix [config: memory.dashboards;
    /// default 64Mi; 1Mi..=16Gi].
    #[arg(long, env = "RAY_XDS_MEMORY_DASHBOARDS", value_parser = parse_bytes)]
    pub memory_dashboards: Option<usize>,

    /// Memory (estimated) the proxies' route tables may hold in all, shared fairly
    /// between clusters [config: memory.route_tables; default 32Mi; 1Mi..=16Gi].
    #[arg(long, env = "RAY_XDS_MEMORY_ROUTE_TABLES", value_parser = parse_bytes)]
    pub memory_route_tables: Option<usize>,

    /// Memory xDS requests still arriving may hold in all, shared fairly between client
    /// addresses; at least twice xds.max_message_bytes [config:
    /// memory.partial_xds_requests; default 64Mi; 1Mi..=16Gi].
    #[arg(long, env = "RAY_XDS_MEMORY_PARTIAL_XDS_REQUESTS", value_parser = parse_bytes)]
    pub memory_partial_xds_requests: Option<usize>,

    /// Every policy setting (probe, dashboard, traffic, switchover), each with its own
    /// flag and environment variable, declared in `policy`.
    #[command(flatten)]
    pub policy: PolicyFlags,
}

/// The policy flags: one per setting declared in `policy`, with its environment variable
/// (`RAY_XDS_` and the flag in upper snake case). Each value is checked by its setting's
/// rule when the command line is parsed.
#[derive(Debug, Clone, Default)]
pub struct PolicyFlags {
    pub overrides: GlobalOverrides,
}

/// Checks one flag's text by the rule of its setting.
fn check_flag(flag: &str, text: &str) -> Result<(), String> {
    let mut one = GlobalOverrides::default();
    one.set_flag(flag, text)?;
    one.validate()
}

impl clap::FromArgMatches for PolicyFlags {
    fn from_arg_matches(matches: &clap::ArgMatches) -> Result<Self, clap::Error> {
        let mut flags = PolicyFlags::default();
        flags.update_from_arg_matches(matches)?;
        Ok(flags)
    }

    fn update_from_arg_matches(&mut self, matches: &clap::ArgMatches) -> Result<(), clap::Error> {
        for field in crate::policy::all_fields() {
            if let Some(text) = matches.get_one::<String>(field.flag) {
                self.overrides.set_flag(field.flag, text).map_err(|e| {
                    clap::Error::raw(
                        clap::error::ErrorKind::ValueValidation,
                        format!("--{}: {e}\n", field.flag),
                    )
                })?;
            }
        }
        Ok(())
    }
}

impl clap::Args for PolicyFlags {
    fn augment_args(mut cmd: clap::Command) -> clap::Command {
        for field in crate::policy::all_fields() {
            // clap keeps `&'static str`s; these few strings live as long as the process.
            let env: &'static str = Box::leak(field.env().into_boxed_str());
            let flag = field.flag;
            cmd = cmd.arg(
                clap::Arg::new(flag)
                    .long(flag)
                    .env(env)
                    .help(format!(
                        "{} [config: {}; default {}; {}]",
                        field.doc,
                        field.path(),
                        (field.default)(),
                        (field.range)()
                    ))
                    .value_parser(move |text: &str| -> Result<String, String> {
                        check_flag(flag, text)?;
                        Ok(text.to_string())
                    }),
            );
        }
        cmd
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Self::augment_args(cmd)
    }
}

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
}

impl Default for MemoryBudgets {
    fn default() -> Self {
        MemoryBudgets {
            dashboards: DASHBOARDS_BUDGET_BYTES,
            route_tables: ROUTE_TABLES_BUDGET_BYTES,
            partial_xds_requests: crate::xds::codec::PARTIAL_REQUESTS_BUDGET_BYTES,
        }
    }
}

/// What the Ray dashboards' statuses may hold in all by default (`live::dashboards`).
pub const DASHBOARDS_BUDGET_BYTES: usize = 64 * 1024 * 1024;

/// What the proxies' route tables may hold in all by default (`live::route_tables`).
pub const ROUTE_TABLES_BUDGET_BYTES: usize = 32 * 1024 * 1024;

/// The range of every memory budget: 1 MiB to 16 GiB.
pub const MEMORY_BUDGET_RANGE: std::ops::RangeInclusive<usize> = (1 << 20)..=(16 << 30);

/// A byte count: digits, optionally followed by a Kubernetes binary suffix (`Ki`, `Mi`,
/// `Gi`), e.g. `65536`, `64Mi`, `1Gi`.
/// A range of ports, `MIN-MAX` (1 to 65535, MIN below MAX), as Ray's settings give them:
/// ports from MIN up to, not including, MAX.
pub fn parse_port_range(text: &str) -> Result<std::ops::RangeInclusive<u16>, String> {
    let bad = || format!("{text:?}: want MIN-MAX, ports 1 to 65535 (e.g. 30000-31000)");
    let (min, max) = text.trim().split_once('-').ok_or_else(bad)?;
    let port = |p: &str| p.trim().parse::<u16>().ok().filter(|p| *p > 0);
    match (port(min), port(max)) {
        (Some(min), Some(max)) if min < max => Ok(min..=max),
        _ => Err(bad()),
    }
}

pub fn parse_bytes(text: &str) -> Result<usize, String> {
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

/// A byte count in the config file: a number of bytes or a string [`parse_bytes`] reads.
#[derive(Debug, Clone, Copy)]
struct ByteCount(usize);

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
    pub fn host_policy(&self) -> Result<crate::model::HostPolicy, String> {
        crate::model::HostPolicy::new(self.allowed_hosts.clone())
    }
}

/// The largest gRPC message accepted from an xDS client, by default (4 MiB).
pub const DEFAULT_XDS_MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;
/// What `xds.max_message_bytes` may be: 64 KiB to 64 MiB.
pub const XDS_MAX_MESSAGE_BYTES_RANGE: std::ops::RangeInclusive<usize> =
    64 * 1024..=64 * 1024 * 1024;

/// What `gateway.connect_timeout` may be: 1 ms to 60 s.
pub const CONNECT_TIMEOUT_RANGE: std::ops::RangeInclusive<Duration> =
    Duration::from_millis(1)..=Duration::from_secs(60);
/// What `source.file.poll_interval` may be: 10 ms to 1 h.
pub const FILE_POLL_INTERVAL_RANGE: std::ops::RangeInclusive<Duration> =
    Duration::from_millis(10)..=Duration::from_secs(3600);
/// At most this many `proxies.networks`.
pub const MAX_PROXY_NETWORKS: usize = 256;

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

// ---- the config file's shape ----

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    #[serde(default)]
    xds: XdsSection,
    #[serde(default)]
    admin: AdminSection,
    #[serde(default)]
    gateway: GatewaySection,
    #[serde(default)]
    source: Option<SourceSection>,
    #[serde(default)]
    proxies: ProxiesSection,
    #[serde(default)]
    probe: probe::GlobalProbe,
    #[serde(default)]
    dashboard: dashboard::GlobalDashboard,
    #[serde(default)]
    traffic: traffic::GlobalTraffic,
    #[serde(default)]
    switchover: switchover::GlobalSwitchover,
    #[serde(default)]
    memory: MemorySection,
    #[serde(default)]
    replicas: ReplicasSection,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ReplicasSection {
    peers: Option<Vec<String>>,
    #[serde(default, with = "humantime_serde")]
    poll_interval: Option<Duration>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct MemorySection {
    dashboards: Option<ByteCount>,
    route_tables: Option<ByteCount>,
    partial_xds_requests: Option<ByteCount>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct XdsSection {
    listen: Option<SocketAddr>,
    max_message_bytes: Option<ByteCount>,
    max_connections: Option<usize>,
    max_connections_per_peer: Option<usize>,
    max_streams: Option<usize>,
    tls: Option<TlsSection>,
}

/// `xds.tls`: all three files, or none.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct TlsSection {
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    client_ca: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ProxiesSection {
    networks: Option<Vec<ipnet::IpNet>>,
    replica_ports: Option<ReplicaPortsSection>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ReplicaPortsSection {
    http: Option<String>,
    grpc: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct AdminSection {
    listen: Option<SocketAddr>,
    debug_listen: Option<SocketAddr>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct GatewaySection {
    #[serde(default)]
    http_listener: ListenerSection,
    #[serde(default, with = "humantime_serde")]
    upstream_idle_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    connect_timeout: Option<Duration>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ListenerSection {
    address: Option<IpAddr>,
    port: Option<u16>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SourceSection {
    file: Option<FileSourceSection>,
    kubernetes: Option<KubernetesSourceConfig>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileSourceSection {
    path: PathBuf,
    #[serde(default, with = "humantime_serde")]
    poll_interval: Option<Duration>,
}

/// `xds.tls` from flags over the file, each path relative to the config file's folder:
/// all three files or none (a certificate without a client CA would accept anyone).
fn tls_files(
    args: &ServeArgs,
    file: Option<TlsSection>,
    base_dir: &Path,
) -> Result<Option<crate::xds::tls::TlsFiles>, ConfigError> {
    let file = file.unwrap_or_default();
    let in_file = |p: Option<PathBuf>| p.map(|p| base_dir.join(p));
    let cert = args.xds_tls_cert.clone().or(in_file(file.cert));
    let key = args.xds_tls_key.clone().or(in_file(file.key));
    let client_ca = args.xds_tls_client_ca.clone().or(in_file(file.client_ca));
    match (cert, key, client_ca) {
        (None, None, None) => Ok(None),
        (Some(cert), Some(key), Some(client_ca)) => Ok(Some(crate::xds::tls::TlsFiles {
            cert,
            key,
            client_ca,
        })),
        (cert, key, client_ca) => {
            let missing: Vec<&str> = [
                ("cert (--xds-tls-cert)", cert.is_none()),
                ("key (--xds-tls-key)", key.is_none()),
                ("client_ca (--xds-tls-client-ca)", client_ca.is_none()),
            ]
            .into_iter()
            .filter_map(|(name, missing)| missing.then_some(name))
            .collect();
            Err(ConfigError::Invalid(format!(
                "xds.tls needs cert, key and client_ca together (mTLS only: a server certificate without a client CA would let anyone read every route); missing: {}",
                missing.join(", ")
            )))
        }
    }
}

/// How errors name the config file: its path, or "the command line" when there is none.
fn config_name(args: &ServeArgs) -> String {
    args.config
        .as_ref()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| "the command line".into())
}

/// Deserializes YAML, reporting errors with the file, line, column and field path.
pub fn parse_yaml<T: serde::de::DeserializeOwned>(
    file: &Path,
    text: &str,
) -> Result<T, ConfigError> {
    let de = serde_yaml::Deserializer::from_str(text);
    serde_path_to_error::deserialize(de).map_err(|err| {
        let field = err.path().to_string();
        let inner = err.into_inner();
        let location = inner
            .location()
            .map(|l| format!("line {}, column {}: ", l.line(), l.column()))
            .unwrap_or_default();
        // serde_yaml appends " at line L column C"; we already said where.
        let mut message = inner.to_string();
        if let Some(at) = message.find(" at line ") {
            message.truncate(at);
        }
        ConfigError::Parse {
            file: file.to_path_buf(),
            location,
            field: if field == "." {
                "(top level)".into()
            } else {
                field
            },
            message,
        }
    })
}

/// The largest `ray-xds.yaml` read (1 MiB; a real one is a few KiB).
pub const MAX_CONFIG_FILE_BYTES: u64 = 1024 * 1024;

fn read_config_file(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(path)?
        .take(MAX_CONFIG_FILE_BYTES + 1)
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_CONFIG_FILE_BYTES {
        return Err(std::io::Error::other(format!(
            "over {} MiB: not a ray-xds config file",
            MAX_CONFIG_FILE_BYTES >> 20
        )));
    }
    String::from_utf8(bytes).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

impl Config {
    /// Reads the config file named by the flags (if any) and applies the flags over it.
    // Over the 100 lines a reader can hold; to split along its seams: one function per section of ray-xds.yaml.
    #[allow(clippy::too_many_lines)]
    pub fn load(args: &ServeArgs) -> Result<Config, ConfigError> {
        let (file, base_dir) = match &args.config {
            Some(path) => {
                let text = read_config_file(path).map_err(|source| ConfigError::Read {
                    file: path.clone(),
                    source,
                })?;
                let parsed: FileConfig = if text.trim().is_empty() {
                    FileConfig::default()
                } else {
                    parse_yaml(path, &text)?
                };
                let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
                (parsed, dir)
            }
            None => (FileConfig::default(), PathBuf::new()),
        };
        let defaults = GatewaySettings::default();
        let gateway = GatewaySettings {
            listener_address: args
                .gateway_address
                .or(file.gateway.http_listener.address)
                .unwrap_or(defaults.listener_address),
            listener_port: args
                .gateway_port
                .or(file.gateway.http_listener.port)
                .unwrap_or(defaults.listener_port),
            upstream_idle_timeout: args
                .upstream_idle_timeout
                .or(file.gateway.upstream_idle_timeout)
                .unwrap_or(defaults.upstream_idle_timeout),
            connect_timeout: args
                .connect_timeout
                .or(file.gateway.connect_timeout)
                .unwrap_or(defaults.connect_timeout),
        };
        // Port 0 stays allowed: Envoy then binds a free port (tests use it).
        let ip = gateway.listener_address;
        if ip.is_multicast() || matches!(ip, IpAddr::V4(v4) if v4.is_broadcast()) {
            return Err(ConfigError::Invalid(format!(
                "gateway.http_listener.address (--gateway-address) is {ip}: Envoy cannot listen on a multicast or broadcast address"
            )));
        }
        // Policies: defaults, then the file's sections, then flags and environment,
        // every value checked by its setting's own rule.
        let from_file = GlobalOverrides {
            probe: file.probe,
            dashboard: file.dashboard,
            traffic: file.traffic,
            switchover: file.switchover,
        };
        from_file
            .validate()
            .map_err(|e| ConfigError::Invalid(format!("{}: {e}", config_name(args))))?;
        let overrides = from_file.or(args.policy.overrides.clone());
        overrides
            .validate()
            .map_err(|e| ConfigError::Invalid(format!("the command line: {e}")))?;
        let policies = Policies::default().with_global(&overrides);
        // The same rule as every policy duration: Envoy reads these in whole
        // milliseconds, so `1ns` would be published as 0 (no idle timeout at all).
        for (field, value) in [
            (
                "gateway.upstream_idle_timeout (--upstream-idle-timeout)",
                gateway.upstream_idle_timeout,
            ),
            (
                "gateway.connect_timeout (--connect-timeout)",
                gateway.connect_timeout,
            ),
        ] {
            crate::policy::Value::check(&value)
                .map_err(|e| ConfigError::Invalid(format!("{field}: {e}")))?;
        }
        if gateway.upstream_idle_timeout.is_zero()
            || gateway.upstream_idle_timeout >= Duration::from_secs(90)
        {
            return Err(ConfigError::Invalid(format!(
                "gateway.upstream_idle_timeout is {}: it must be above 0 and below Ray Serve's 90s keep-alive, or Envoy reuses connections the proxy is closing",
                humantime::format_duration(gateway.upstream_idle_timeout)
            )));
        }
        if !CONNECT_TIMEOUT_RANGE.contains(&gateway.connect_timeout) {
            return Err(ConfigError::Invalid(format!(
                "gateway.connect_timeout (--connect-timeout) is {}: it must be in {}..={}",
                humantime::format_duration(gateway.connect_timeout),
                humantime::format_duration(*CONNECT_TIMEOUT_RANGE.start()),
                humantime::format_duration(*CONNECT_TIMEOUT_RANGE.end()),
            )));
        }
        let max_message = args
            .xds_max_message_bytes
            .or(file.xds.max_message_bytes.map(|b| b.0))
            .unwrap_or(DEFAULT_XDS_MAX_MESSAGE_BYTES);
        if !XDS_MAX_MESSAGE_BYTES_RANGE.contains(&max_message) {
            return Err(ConfigError::Invalid(format!(
                "xds.max_message_bytes (--xds-max-message-bytes) is {max_message}: it must be in {}..={} (a DiscoveryRequest of a few thousand names fits in 64 KiB)",
                XDS_MAX_MESSAGE_BYTES_RANGE.start(),
                XDS_MAX_MESSAGE_BYTES_RANGE.end()
            )));
        }
        let bounded = |field: &str,
                       flag: &str,
                       value: Option<usize>,
                       default: usize,
                       range: std::ops::RangeInclusive<usize>|
         -> Result<usize, ConfigError> {
            let v = value.unwrap_or(default);
            if range.contains(&v) {
                Ok(v)
            } else {
                Err(ConfigError::Invalid(format!(
                    "{field} (--{flag}) is {v}: it must be in {}..={}",
                    range.start(),
                    range.end()
                )))
            }
        };
        let listener_defaults = crate::xds::listener::Limits::default();
        let xds_limits = crate::xds::listener::Limits {
            max_connections: bounded(
                "xds.max_connections",
                "xds-max-connections",
                args.xds_max_connections.or(file.xds.max_connections),
                listener_defaults.max_connections,
                1..=65_536,
            )?,
            max_connections_per_peer: bounded(
                "xds.max_connections_per_peer",
                "xds-max-connections-per-peer",
                args.xds_max_connections_per_peer
                    .or(file.xds.max_connections_per_peer),
                listener_defaults.max_connections_per_peer,
                1..=65_536,
            )?,
            handshake_timeout: listener_defaults.handshake_timeout,
            idle_timeout: listener_defaults.idle_timeout,
        };
        let xds_max_streams = bounded(
            "xds.max_streams",
            "xds-max-streams",
            args.xds_max_streams.or(file.xds.max_streams),
            crate::xds::server::DEFAULT_MAX_STREAMS,
            1..=1_000_000,
        )?;
        let defaults = MemoryBudgets::default();
        let budget = |field: &str, flag: &str, value: Option<usize>, default: usize| {
            let v = value.unwrap_or(default);
            if MEMORY_BUDGET_RANGE.contains(&v) {
                Ok(v)
            } else {
                Err(ConfigError::Invalid(format!(
                    "{field} (--{flag}) is {v} bytes: it must be in 1Mi..=16Gi"
                )))
            }
        };
        let memory = MemoryBudgets {
            dashboards: budget(
                "memory.dashboards",
                "memory-dashboards",
                args.memory_dashboards
                    .or(file.memory.dashboards.map(|b| b.0)),
                defaults.dashboards,
            )?,
            route_tables: budget(
                "memory.route_tables",
                "memory-route-tables",
                args.memory_route_tables
                    .or(file.memory.route_tables.map(|b| b.0)),
                defaults.route_tables,
            )?,
            partial_xds_requests: budget(
                "memory.partial_xds_requests",
                "memory-partial-xds-requests",
                args.memory_partial_xds_requests
                    .or(file.memory.partial_xds_requests.map(|b| b.0)),
                // Unset: room for two of the largest messages at least.
                defaults
                    .partial_xds_requests
                    .max(max_message.saturating_mul(2)),
            )?,
        };
        if memory.partial_xds_requests < max_message.saturating_mul(2) {
            return Err(ConfigError::Invalid(format!(
                "memory.partial_xds_requests (--memory-partial-xds-requests) is {} bytes: it must be at least twice xds.max_message_bytes ({max_message}), or no request of that size could arrive beside another",
                memory.partial_xds_requests
            )));
        }
        let (file_source, kubernetes) = match file.source {
            Some(s) => (s.file, s.kubernetes),
            None => (None, None),
        };
        if file_source.is_some() && kubernetes.is_some() {
            return Err(ConfigError::Invalid(
                "source: set either file or kubernetes, not both".into(),
            ));
        }
        let kubernetes =
            kubernetes.or_else(|| args.source_kubernetes.then(KubernetesSourceConfig::default));
        let source = match (&args.source_file, &file_source, kubernetes) {
            (Some(_), _, _) | (None, Some(_), _) => {
                let path = match (&args.source_file, &file_source) {
                    (Some(p), _) => p.clone(),
                    (None, f) => base_dir.join(&f.as_ref().expect("matched above").path),
                };
                let poll_interval = args
                    .source_file_poll_interval
                    .or(file_source.as_ref().and_then(|f| f.poll_interval))
                    .unwrap_or(Duration::from_secs(1));
                if !FILE_POLL_INTERVAL_RANGE.contains(&poll_interval) {
                    return Err(ConfigError::Invalid(format!(
                        "source.file.poll_interval (--source-file-poll-interval) is {}: it must be in {}..={}",
                        humantime::format_duration(poll_interval),
                        humantime::format_duration(*FILE_POLL_INTERVAL_RANGE.start()),
                        humantime::format_duration(*FILE_POLL_INTERVAL_RANGE.end()),
                    )));
                }
                SourceConfig::File {
                    path,
                    poll_interval,
                }
            }
            (None, None, Some(k)) => {
                if k.namespaces.iter().any(|n| n.is_empty()) {
                    return Err(ConfigError::Invalid(
                        "source.kubernetes.namespaces: a namespace name is empty".into(),
                    ));
                }
                if let Err(e) = k.host_policy() {
                    return Err(ConfigError::Invalid(format!(
                        "source.kubernetes.allowed_hosts: {e}"
                    )));
                }
                SourceConfig::Kubernetes(k)
            }
            (None, None, None) => return Err(ConfigError::Invalid(
                "no source configured: set source.file.path or source.kubernetes in the config file, or pass --source-file or --source-kubernetes"
                    .into(),
            )),
        };
        let networks = args
            .proxy_networks
            .clone()
            .or(file.proxies.networks)
            .unwrap_or_default();
        if networks.len() > MAX_PROXY_NETWORKS {
            return Err(ConfigError::Invalid(format!(
                "proxies.networks lists {} networks: at most {MAX_PROXY_NETWORKS}",
                networks.len()
            )));
        }
        let file_ports = file.proxies.replica_ports.unwrap_or_default();
        let replica_ports = |flag: &Option<std::ops::RangeInclusive<u16>>,
                             file: Option<String>,
                             key: &str,
                             default: std::ops::RangeInclusive<u16>| {
            match (flag, file) {
                (Some(range), _) => Ok(range.clone()),
                (None, Some(text)) => parse_port_range(&text).map_err(|why| {
                    ConfigError::Invalid(format!("proxies.replica_ports.{key}: {why}"))
                }),
                (None, None) => Ok(default),
            }
        };
        let defaults = crate::model::ReplicaPorts::default();
        let addresses = crate::model::AddressPolicy {
            networks: networks.into_iter().map(|n| n.trunc()).collect(),
            replica_ports: crate::model::ReplicaPorts {
                http: replica_ports(
                    &args.replica_http_ports,
                    file_ports.http,
                    "http",
                    defaults.http,
                )?,
                grpc: replica_ports(
                    &args.replica_grpc_ports,
                    file_ports.grpc,
                    "grpc",
                    defaults.grpc,
                )?,
            },
        };
        let xds_tls = tls_files(args, file.xds.tls, &base_dir)?;
        let admin_listen = args
            .admin_listen
            .or(file.admin.listen)
            .unwrap_or(SocketAddr::from(([127, 0, 0, 1], 19000)));
        let admin_debug_listen = args.admin_debug_listen.or(file.admin.debug_listen);
        let replica_peers = args
            .replica_peers
            .clone()
            .or(file.replicas.peers)
            .unwrap_or_default();
        if replica_peers.len() > 64 {
            return Err(ConfigError::Invalid(format!(
                "replicas.peers lists {} addresses: at most 64",
                replica_peers.len()
            )));
        }
        for peer in &replica_peers {
            let port = peer.rsplit_once(':').and_then(|(host, port)| {
                (!host.is_empty())
                    .then(|| port.parse::<u16>().ok())
                    .flatten()
            });
            if port.is_none_or(|p| p == 0) {
                return Err(ConfigError::Invalid(format!(
                    "replicas.peers (--replica-peers): {peer:?} is not host:port (a peer's admin address)"
                )));
            }
        }
        let replica_poll_interval = file
            .replicas
            .poll_interval
            .unwrap_or(Duration::from_millis(500));
        if !(Duration::from_millis(50)..=Duration::from_secs(60)).contains(&replica_poll_interval) {
            return Err(ConfigError::Invalid(format!(
                "replicas.poll_interval is {}: it must be in 50ms..=1m",
                humantime::format_duration(replica_poll_interval)
            )));
        }
        if admin_debug_listen.is_some_and(|d| d == admin_listen && d.port() != 0) {
            return Err(ConfigError::Invalid(format!(
                "admin.debug_listen (--admin-debug-listen) is admin.listen's address {admin_listen}: leave it out to serve /debug/* there"
            )));
        }
        Ok(Config {
            policies,
            addresses,
            xds_listen: args
                .xds_listen
                .or(file.xds.listen)
                .unwrap_or(SocketAddr::from(([127, 0, 0, 1], 18000))),
            xds_max_message_bytes: max_message,
            xds_limits,
            xds_max_streams,
            xds_tls,
            admin_listen,
            admin_debug_listen,
            replica_peers,
            replica_poll_interval,
            gateway,
            source,
            memory,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
        let Command::Serve(args) = cli.command;
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
        let Command::Serve(args) = cli.command;
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
        let c = load("xds: { max_connections: 10, max_connections_per_peer: 3, max_streams: 50 }\nsource: { file: { path: a.yaml } }\n").unwrap();
        assert_eq!(c.xds_limits.max_connections, 10);
        assert_eq!(c.xds_limits.max_connections_per_peer, 3);
        assert_eq!(c.xds_max_streams, 50);
        for (field, bad) in [
            ("max_connections", "0"),
            ("max_connections", "65537"),
            ("max_connections_per_peer", "0"),
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
        let c = load("memory: { dashboards: 128Mi, route_tables: 8388608, partial_xds_requests: 1Gi }\nsource: { file: { path: a.yaml } }\n").unwrap();
        assert_eq!(
            c.memory,
            MemoryBudgets {
                dashboards: 128 << 20,
                route_tables: 8 << 20,
                partial_xds_requests: 1 << 30,
            }
        );
        for (field, bad) in [
            ("dashboards", "0"),
            ("dashboards", "1023Ki"),
            ("route_tables", "17Gi"),
            ("route_tables", "18446744073709551615"),
            ("partial_xds_requests", "1Mi"), // under twice the 4 MiB message
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
        let Command::Serve(args) = cli.command;
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
        let Command::Serve(args) = cli.command;
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
