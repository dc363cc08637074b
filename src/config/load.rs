//! [`Config::load`]: `ray-xds.yaml` read and parsed (errors name the file, line and
//! field), then one function per section putting the flags over the file and checking the
//! result against its setting's rule.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::file::*;
use super::*;
use crate::policy::{GlobalOverrides, Policies};

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

/// The xDS, admin and debug listeners cannot share a port where their addresses overlap
/// (the same address, or one of them every address): the second bind would fail at start.
fn distinct_listeners(
    xds: SocketAddr,
    admin: SocketAddr,
    debug: Option<SocketAddr>,
) -> Result<(), ConfigError> {
    let overlap = |a: SocketAddr, b: SocketAddr| {
        a.port() != 0
            && a.port() == b.port()
            && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
    };
    let mut named = vec![("xds.listen", xds), ("admin.listen", admin)];
    named.extend(debug.map(|d| ("admin.debug_listen", d)));
    for (i, (a_name, a)) in named.iter().enumerate() {
        for (b_name, b) in &named[i + 1..] {
            if overlap(*a, *b) {
                return Err(ConfigError::Invalid(format!(
                    "{a_name} ({a}) and {b_name} ({b}) would share a port: give each its own"
                )));
            }
        }
    }
    Ok(())
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

pub(super) fn read_config_file(path: &Path) -> std::io::Result<String> {
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
    /// Reads the config file named by the flags (if any) and applies the flags over it,
    /// section by section.
    pub fn load(args: &ServeArgs) -> Result<Config, ConfigError> {
        let (file, base_dir) = read_file(args)?;
        let gateway = gateway(args, file.gateway)?;
        let policies = policies(
            args,
            GlobalOverrides {
                probe: file.probe,
                dashboard: file.dashboard,
                traffic: file.traffic,
                switchover: file.switchover,
            },
        )?;
        let xds = xds(args, file.xds, &base_dir)?;
        let memory = memory(args, file.memory, xds.max_message_bytes)?;
        let source = source(args, file.source, &base_dir)?;
        let addresses = addresses(args, file.proxies)?;
        let (admin_listen, admin_debug_listen) = admin(args, file.admin)?;
        distinct_listeners(xds.listen, admin_listen, admin_debug_listen)?;
        let kubernetes_source = matches!(source, SourceConfig::Kubernetes(_));
        let (replica_peers, replica_poll_interval, replica_state) =
            replicas(args, file.replicas, &base_dir, kubernetes_source)?;
        Ok(Config {
            policies,
            addresses,
            xds_listen: xds.listen,
            xds_max_message_bytes: xds.max_message_bytes,
            xds_limits: xds.limits,
            xds_max_streams: xds.max_streams,
            xds_tls: xds.tls,
            admin_listen,
            admin_debug_listen,
            replica_peers,
            replica_poll_interval,
            replica_state,
            gateway,
            source,
            memory,
        })
    }
}

/// The config file named by the flags, parsed (an empty one is all defaults), and the
/// folder its relative paths start from.
fn read_file(args: &ServeArgs) -> Result<(FileConfig, PathBuf), ConfigError> {
    let Some(path) = &args.config else {
        return Ok((FileConfig::default(), PathBuf::new()));
    };
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
    Ok((parsed, dir))
}

/// `gateway:`: the listener Envoy is given, and its upstream timeouts.
fn gateway(args: &ServeArgs, file: GatewaySection) -> Result<GatewaySettings, ConfigError> {
    let defaults = GatewaySettings::default();
    let gateway = GatewaySettings {
        listener_address: args
            .gateway_address
            .or(file.http_listener.address)
            .unwrap_or(defaults.listener_address),
        listener_port: args
            .gateway_port
            .or(file.http_listener.port)
            .unwrap_or(defaults.listener_port),
        upstream_idle_timeout: args
            .upstream_idle_timeout
            .or(file.upstream_idle_timeout)
            .unwrap_or(defaults.upstream_idle_timeout),
        connect_timeout: args
            .connect_timeout
            .or(file.connect_timeout)
            .unwrap_or(defaults.connect_timeout),
    };
    // Port 0 stays allowed: Envoy then binds a free port (tests use it).
    let ip = gateway.listener_address;
    if ip.is_multicast() || matches!(ip, IpAddr::V4(v4) if v4.is_broadcast()) {
        return Err(ConfigError::Invalid(format!(
            "gateway.http_listener.address (--gateway-address) is {ip}: Envoy cannot listen on a multicast or broadcast address"
        )));
    }
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
    Ok(gateway)
}

/// `probe:`, `dashboard:`, `traffic:`, `switchover:`: defaults, then the file's sections,
/// then flags and environment, every value checked by its setting's own rule.
fn policies(args: &ServeArgs, from_file: GlobalOverrides) -> Result<Policies, ConfigError> {
    from_file
        .validate()
        .map_err(|e| ConfigError::Invalid(format!("{}: {e}", config_name(args))))?;
    let overrides = from_file.or(args.policy.overrides.clone());
    overrides
        .validate()
        .map_err(|e| ConfigError::Invalid(format!("the command line: {e}")))?;
    Ok(Policies::default().with_global(&overrides))
}

/// `xds:`, checked.
struct XdsSettings {
    listen: SocketAddr,
    max_message_bytes: usize,
    limits: crate::xds::listener::Limits,
    max_streams: usize,
    tls: Option<crate::xds::tls::TlsFiles>,
}

/// A count from a flag, the file or its default, refused outside `range`.
fn bounded(
    field: &str,
    flag: &str,
    value: Option<usize>,
    default: usize,
    range: std::ops::RangeInclusive<usize>,
) -> Result<usize, ConfigError> {
    let shown = format!("{}..={}", range.start(), range.end());
    within(field, flag, value.unwrap_or(default), &range, "", &shown)
}

/// `value` of `field` (flag `--flag`) if it is in `range`; else an error naming the
/// value with its `unit` and the range as `shown`.
fn within(
    field: &str,
    flag: &str,
    value: usize,
    range: &std::ops::RangeInclusive<usize>,
    unit: &str,
    shown: &str,
) -> Result<usize, ConfigError> {
    if range.contains(&value) {
        Ok(value)
    } else {
        Err(ConfigError::Invalid(format!(
            "{field} (--{flag}) is {value}{unit}: it must be in {shown}"
        )))
    }
}

/// `xds:`: the listener, its message and connection bounds, and mTLS.
fn xds(args: &ServeArgs, file: XdsSection, base_dir: &Path) -> Result<XdsSettings, ConfigError> {
    let max_message_bytes = args
        .xds_max_message_bytes
        .or(file.max_message_bytes.map(|b| b.0))
        .unwrap_or(DEFAULT_XDS_MAX_MESSAGE_BYTES);
    if !XDS_MAX_MESSAGE_BYTES_RANGE.contains(&max_message_bytes) {
        return Err(ConfigError::Invalid(format!(
            "xds.max_message_bytes (--xds-max-message-bytes) is {max_message_bytes}: it must be in {}..={} (a DiscoveryRequest of a few thousand names fits in 64 KiB)",
            XDS_MAX_MESSAGE_BYTES_RANGE.start(),
            XDS_MAX_MESSAGE_BYTES_RANGE.end()
        )));
    }
    let listener_defaults = crate::xds::listener::Limits::default();
    let limits = crate::xds::listener::Limits {
        max_connections: bounded(
            "xds.max_connections",
            "xds-max-connections",
            args.xds_max_connections.or(file.max_connections),
            listener_defaults.max_connections,
            1..=65_536,
        )?,
        max_connections_per_peer: bounded(
            "xds.max_connections_per_peer",
            "xds-max-connections-per-peer",
            args.xds_max_connections_per_peer
                .or(file.max_connections_per_peer),
            listener_defaults.max_connections_per_peer,
            1..=65_536,
        )?,
        handshake_timeout: listener_defaults.handshake_timeout,
        idle_timeout: listener_defaults.idle_timeout,
        write_deadline: listener_defaults.write_deadline,
        handshakes_per_peer_per_second: bounded(
            "xds.handshakes_per_peer_per_second",
            "xds-handshakes-per-peer-per-second",
            args.xds_handshakes_per_peer_per_second
                .or(file.handshakes_per_peer_per_second),
            listener_defaults.handshakes_per_peer_per_second as usize,
            0..=100_000,
        )? as u32,
    };
    let max_streams = bounded(
        "xds.max_streams",
        "xds-max-streams",
        args.xds_max_streams.or(file.max_streams),
        crate::xds::server::DEFAULT_MAX_STREAMS,
        1..=1_000_000,
    )?;
    Ok(XdsSettings {
        listen: args
            .xds_listen
            .or(file.listen)
            .unwrap_or(SocketAddr::from(([127, 0, 0, 1], 18000))),
        max_message_bytes,
        limits,
        max_streams,
        tls: tls_files(args, file.tls, base_dir)?,
    })
}

/// `memory:`: each bounded holding's budget; requests still arriving need room for two
/// of the largest messages.
fn memory(
    args: &ServeArgs,
    file: MemorySection,
    max_message: usize,
) -> Result<MemoryBudgets, ConfigError> {
    let defaults = MemoryBudgets::default();
    let budget = |field: &str, flag: &str, value: Option<usize>, default: usize| {
        let value = value.unwrap_or(default);
        within(
            field,
            flag,
            value,
            &MEMORY_BUDGET_RANGE,
            " bytes",
            "1Mi..=16Gi",
        )
    };
    let memory = MemoryBudgets {
        dashboards: budget(
            "memory.dashboards",
            "memory-dashboards",
            args.memory_dashboards.or(file.dashboards.map(|b| b.0)),
            defaults.dashboards,
        )?,
        route_tables: budget(
            "memory.route_tables",
            "memory-route-tables",
            args.memory_route_tables.or(file.route_tables.map(|b| b.0)),
            defaults.route_tables,
        )?,
        partial_xds_requests: budget(
            "memory.partial_xds_requests",
            "memory-partial-xds-requests",
            args.memory_partial_xds_requests
                .or(file.partial_xds_requests.map(|b| b.0)),
            // Unset: room for two of the largest messages at least.
            defaults
                .partial_xds_requests
                .max(max_message.saturating_mul(2)),
        )?,
        xds_responses: budget(
            "memory.xds_responses",
            "memory-xds-responses",
            args.memory_xds_responses
                .or(file.xds_responses.map(|b| b.0)),
            defaults.xds_responses,
        )?,
    };
    if memory.partial_xds_requests < max_message.saturating_mul(2) {
        return Err(ConfigError::Invalid(format!(
            "memory.partial_xds_requests (--memory-partial-xds-requests) is {} bytes: it must be at least twice xds.max_message_bytes ({max_message}), or no request of that size could arrive beside another",
            memory.partial_xds_requests
        )));
    }
    Ok(memory)
}

/// `source:`: a services file or Kubernetes, one of them.
fn source(
    args: &ServeArgs,
    file: Option<SourceSection>,
    base_dir: &Path,
) -> Result<SourceConfig, ConfigError> {
    let (file_source, kubernetes) = match file {
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
    match (&args.source_file, file_source, kubernetes) {
        (Some(path), file_source, _) => file_source_config(args, path.clone(), file_source),
        (None, Some(f), _) => {
            let path = base_dir.join(&f.path);
            file_source_config(args, path, Some(f))
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
            if let Some(url) = &k.api_server {
                let uri: Result<http::Uri, _> = url.parse();
                if !uri.is_ok_and(|u| {
                    matches!(u.scheme_str(), Some("http" | "https")) && u.host().is_some()
                }) {
                    return Err(ConfigError::Invalid(format!(
                        "source.kubernetes.api_server: {url:?} is not an http:// or https:// URL"
                    )));
                }
            }
            Ok(SourceConfig::Kubernetes(k))
        }
        (None, None, None) => Err(ConfigError::Invalid(
            "no source configured: set source.file.path or source.kubernetes in the config file, or pass --source-file or --source-kubernetes"
                .into(),
        )),
    }
}

/// `source.file:`: the services file at `path`, polled.
fn file_source_config(
    args: &ServeArgs,
    path: PathBuf,
    file: Option<FileSourceSection>,
) -> Result<SourceConfig, ConfigError> {
    let poll_interval = args
        .source_file_poll_interval
        .or(file.and_then(|f| f.poll_interval))
        .unwrap_or(Duration::from_secs(1));
    if !FILE_POLL_INTERVAL_RANGE.contains(&poll_interval) {
        return Err(ConfigError::Invalid(format!(
            "source.file.poll_interval (--source-file-poll-interval) is {}: it must be in {}..={}",
            humantime::format_duration(poll_interval),
            humantime::format_duration(*FILE_POLL_INTERVAL_RANGE.start()),
            humantime::format_duration(*FILE_POLL_INTERVAL_RANGE.end()),
        )));
    }
    Ok(SourceConfig::File {
        path,
        poll_interval,
    })
}

/// `proxies:`: the networks proxies may be published from, and the ports Ray's ingress
/// replicas may listen on.
fn addresses(
    args: &ServeArgs,
    file: ProxiesSection,
) -> Result<crate::model::AddressPolicy, ConfigError> {
    let networks = args
        .proxy_networks
        .clone()
        .or(file.networks)
        .unwrap_or_default();
    if networks.len() > MAX_PROXY_NETWORKS {
        return Err(ConfigError::Invalid(format!(
            "proxies.networks lists {} networks: at most {MAX_PROXY_NETWORKS}",
            networks.len()
        )));
    }
    let file_ports = file.replica_ports.unwrap_or_default();
    let replica_ports = |flag: &Option<std::ops::RangeInclusive<u16>>,
                         file: Option<String>,
                         key: &str,
                         default: std::ops::RangeInclusive<u16>| {
        match (flag, file) {
            (Some(range), _) => Ok(range.clone()),
            (None, Some(text)) => parse_port_range(&text)
                .map_err(|why| ConfigError::Invalid(format!("proxies.replica_ports.{key}: {why}"))),
            (None, None) => Ok(default),
        }
    };
    let defaults = crate::model::ReplicaPorts::default();
    Ok(crate::model::AddressPolicy {
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
    })
}

/// `admin:`: the admin address, and where `/debug/*` goes when not there.
fn admin(
    args: &ServeArgs,
    file: AdminSection,
) -> Result<(SocketAddr, Option<SocketAddr>), ConfigError> {
    let admin_listen = args
        .admin_listen
        .or(file.listen)
        .unwrap_or(SocketAddr::from(([127, 0, 0, 1], 19000)));
    let admin_debug_listen = args.admin_debug_listen.or(file.debug_listen);
    if admin_debug_listen.is_some_and(|d| d == admin_listen && d.port() != 0) {
        return Err(ConfigError::Invalid(format!(
            "admin.debug_listen (--admin-debug-listen) is admin.listen's address {admin_listen}: leave it out to serve /debug/* there"
        )));
    }
    Ok((admin_listen, admin_debug_listen))
}

/// `replicas:`: the peers' admin addresses (`host:port`, at most 64), how often they
/// are asked, and where the replicas keep their switchover views.
fn replicas(
    args: &ServeArgs,
    file: ReplicasSection,
    base_dir: &Path,
    kubernetes_source: bool,
) -> Result<(Vec<String>, Duration, Option<ReplicaStateConfig>), ConfigError> {
    let peers = args
        .replica_peers
        .clone()
        .or(file.peers)
        .unwrap_or_default();
    if peers.len() > 64 {
        return Err(ConfigError::Invalid(format!(
            "replicas.peers lists {} addresses: at most 64",
            peers.len()
        )));
    }
    for peer in &peers {
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
    let poll_interval = file.poll_interval.unwrap_or(Duration::from_millis(500));
    if !(Duration::from_millis(50)..=Duration::from_secs(60)).contains(&poll_interval) {
        return Err(ConfigError::Invalid(format!(
            "replicas.poll_interval is {}: it must be in 50ms..=1m",
            humantime::format_duration(poll_interval)
        )));
    }
    let state = replica_state(args, file.state, base_dir, kubernetes_source)?;
    Ok((peers, poll_interval, state))
}

/// `replicas.state`: a directory (`--replica-state-dir` wins over the file), or a
/// ConfigMap `namespace/name` with the Kubernetes source; `ttl` in 1m..=24h (15m).
fn replica_state(
    args: &ServeArgs,
    file: Option<ReplicaStateSection>,
    base_dir: &Path,
    kubernetes_source: bool,
) -> Result<Option<ReplicaStateConfig>, ConfigError> {
    let file = file.unwrap_or_default();
    let ttl = file.ttl.unwrap_or(Duration::from_secs(15 * 60));
    if !(Duration::from_secs(60)..=Duration::from_secs(24 * 3600)).contains(&ttl) {
        return Err(ConfigError::Invalid(format!(
            "replicas.state.ttl is {}: it must be in 1m..=24h",
            humantime::format_duration(ttl)
        )));
    }
    if file.dir.as_ref().is_some_and(|d| d.as_os_str().is_empty()) {
        return Err(ConfigError::Invalid("replicas.state.dir is empty".into()));
    }
    let dir = args
        .replica_state_dir
        .clone()
        .or_else(|| file.dir.map(|d| base_dir.join(d)));
    let store = match (dir, file.configmap) {
        (Some(_), Some(_)) if args.replica_state_dir.is_none() => {
            return Err(ConfigError::Invalid(
                "replicas.state: set either dir or configmap, not both".into(),
            ))
        }
        (Some(dir), _) => {
            if dir.as_os_str().is_empty() {
                return Err(ConfigError::Invalid(
                    "replicas.state.dir (--replica-state-dir) is empty".into(),
                ));
            }
            ReplicaStateStore::Dir(dir)
        }
        (None, Some(configmap)) => {
            if !kubernetes_source {
                return Err(ConfigError::Invalid(format!(
                    "replicas.state.configmap {configmap:?} needs the Kubernetes source (source.kubernetes); with another source keep the state in a directory (replicas.state.dir)"
                )));
            }
            let (namespace, name) = configmap
                .split_once('/')
                .filter(|(ns, name)| is_dns_label(ns) && is_dns_subdomain(name))
                .ok_or_else(|| {
                    ConfigError::Invalid(format!(
                        "replicas.state.configmap {configmap:?} is not namespace/name (e.g. ray-xds/ray-xds-state)"
                    ))
                })?;
            ReplicaStateStore::ConfigMap {
                namespace: namespace.to_string(),
                name: name.to_string(),
            }
        }
        (None, None) => return Ok(None),
    };
    Ok(Some(ReplicaStateConfig { store, ttl }))
}

/// A Kubernetes namespace name: a DNS label (RFC 1123), at most 63 characters.
fn is_dns_label(text: &str) -> bool {
    !text.is_empty()
        && text.len() <= 63
        && text
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !text.starts_with('-')
        && !text.ends_with('-')
}

/// A ConfigMap name: DNS labels joined by dots, at most 253 characters.
fn is_dns_subdomain(text: &str) -> bool {
    text.len() <= 253 && text.split('.').all(is_dns_label)
}
