//! The `ray-xds` command line: its subcommands and the flags of `serve`, each with its
//! `RAY_XDS_*` environment variable; `Config::load` puts them over the config file.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use super::{parse_bytes, parse_port_range};
use crate::policy::GlobalOverrides;

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
    /// Check the config (and the services file or the Kubernetes source's settings, and
    /// the TLS files) as `serve` would at start, without serving: exit 0 with a summary,
    /// or 1 with what is wrong (file, line and field).
    Check(CheckArgs),
    /// Show what a running replica serves (per RayService: serving cluster, weights, switch
    /// phase and why it waits) and what each Envoy holds (versions ACKed, anything NACKed),
    /// from its admin API.
    Status(StatusArgs),
}

/// Flags of `ray-xds status`.
#[derive(Debug, Args, Clone)]
pub struct StatusArgs {
    /// The replica's debug pages: `admin.debug_listen` when set (deploy/: `kubectl -n
    /// ray-xds port-forward deploy/ray-xds 19001`, then http://127.0.0.1:19001), else
    /// `admin.listen`.
    #[arg(
        long,
        env = "RAY_XDS_STATUS_ADMIN",
        default_value = "http://127.0.0.1:19000"
    )]
    pub admin: String,

    /// `table` for people, `json` for scripts.
    #[arg(long, value_enum, default_value_t = StatusOutput::Table)]
    pub output: StatusOutput,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StatusOutput {
    Table,
    Json,
}

/// Flags of `ray-xds check`: every flag of `serve`, and `--offline`.
#[derive(Debug, Args, Default, Clone)]
pub struct CheckArgs {
    /// Check the config alone: read none of the files it names (services file, TLS
    /// files), for a config checked away from where it runs (CI, a review).
    #[arg(long)]
    pub offline: bool,

    #[command(flatten)]
    pub serve: ServeArgs,
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

    /// A directory where this replica keeps its switchover view (a file per replica), so
    /// that a restart of every replica at once resumes shifts, rollbacks and drains
    /// [config: replicas.state.dir, or replicas.state.configmap; default: kept nowhere].
    #[arg(long, env = "RAY_XDS_REPLICA_STATE_DIR")]
    pub replica_state_dir: Option<PathBuf>,

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

    /// TLS handshakes one IP address may begin a second, after a burst of
    /// as many; the rest are closed before any handshake work; 0 is no limit
    /// [config: xds.handshakes_per_peer_per_second; default 20; 0..=100000].
    #[arg(long, env = "RAY_XDS_XDS_HANDSHAKES_PER_PEER_PER_SECOND")]
    pub xds_handshakes_per_peer_per_second: Option<usize>,

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

    /// Memory ADS responses built and not yet written may hold in all, shared fairly
    /// between client addresses (past it, streams wait to build theirs) [config:
    /// memory.xds_responses; default 64Mi; 1Mi..=16Gi].
    #[arg(long, env = "RAY_XDS_MEMORY_XDS_RESPONSES", value_parser = parse_bytes)]
    pub memory_xds_responses: Option<usize>,

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
