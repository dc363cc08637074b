//! `ray-xds check`: everything `serve` refuses at start, without serving.
//!
//! It loads the config exactly as `serve` does (flags, `RAY_XDS_*`, the config file), then
//! reads what the config names: the services file of the file source (parsed and validated
//! into a model, as the source would publish it), the xDS TLS files (loaded as the
//! listener would) and the Kubernetes source's credentials (found and parsed as the
//! source finds them: the kubeconfig, else the pod's service account; an auth plugin the
//! kubeconfig names is named, not run). Nothing is contacted. `--offline` stops after the
//! config itself, for a config checked away from where it runs (CI, a review), whose
//! files are not there.
//!
//! Invariant: a config `check` accepts without `--offline` starts `serve` past its config
//! and file checks; one it refuses, `serve` refuses too, with the same message.

use std::fmt::Write as _;

use crate::config::{CheckArgs, Config, ConfigError, ReplicaStateStore, SourceConfig};

/// Why `check` refused: the message names the file and, where the file has one, the line
/// and the field.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("xds.tls: loading the xDS listener's certificate files: {0}")]
    Tls(#[from] crate::xds::tls::TlsError),
    #[error("{0:#}")]
    Kubernetes(anyhow::Error),
}

/// Checks what `args` names; on success, a summary of what `serve` would run with.
pub async fn check(args: &CheckArgs) -> Result<String, CheckError> {
    let config = Config::load(&args.serve)?;
    let mut out = String::new();
    let config_name = args
        .serve
        .config
        .as_ref()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| "(no file: flags and environment only)".into());
    let _ = writeln!(out, "config: {config_name}");
    let tls = match &config.xds_tls {
        None => "plain TCP".to_string(),
        Some(files) if args.offline => format!(
            "mTLS ({}, {}, {}: not read, --offline)",
            files.cert.display(),
            files.key.display(),
            files.client_ca.display()
        ),
        Some(files) => {
            crate::xds::tls::ServerTls::load(files.clone())?;
            "mTLS (certificate, key and client CA read)".to_string()
        }
    };
    let _ = writeln!(out, "xds: {} ({tls})", config.xds_listen);
    let _ = writeln!(
        out,
        "admin: {}{}",
        config.admin_listen,
        config
            .admin_debug_listen
            .map(|d| format!(" (/debug/* on {d})"))
            .unwrap_or_default()
    );
    match &config.source {
        SourceConfig::File { path, .. } if args.offline => {
            let _ = writeln!(out, "source: file {} (not read, --offline)", path.display());
        }
        SourceConfig::File { path, .. } => {
            let (model, _) = crate::source::file::load(path)?;
            let services = model.services();
            let clusters: usize = services.iter().map(|s| s.clusters.len()).sum();
            let proxies: usize = services
                .iter()
                .flat_map(|s| &s.clusters)
                .map(|c| c.proxies.len())
                .sum();
            let _ = writeln!(
                out,
                "source: file {}: {} RayService(s), {clusters} cluster(s), {proxies} listed proxy(ies)",
                path.display(),
                services.len(),
            );
            for s in services {
                let _ = writeln!(
                    out,
                    "  {}/{}: active {}{}",
                    s.namespace,
                    s.name,
                    s.active_cluster,
                    s.pending_cluster
                        .as_ref()
                        .map(|p| format!(", pending {p}"))
                        .unwrap_or_default()
                );
            }
        }
        SourceConfig::Kubernetes(k) => {
            let namespaces = if k.namespaces.is_empty() {
                "all namespaces".to_string()
            } else {
                k.namespaces.join(", ")
            };
            let selector = match k.rayservice_selector.as_deref() {
                None | Some("") => String::new(),
                Some(s) => format!(", RayServices matching {s}"),
            };
            let _ = writeln!(
                out,
                "source: kubernetes ({namespaces}{selector}; {} namespace(s) with extra hosts; the API server is not contacted)",
                k.allowed_hosts.len()
            );
            if args.offline {
                let _ = writeln!(out, "  credentials: not looked for, --offline");
            } else {
                use crate::source::kubernetes::{
                    auth_command, client_of, credentials, CredentialsFrom,
                };
                let (found, from) = credentials(k).await.map_err(CheckError::Kubernetes)?;
                let url = found.cluster_url.clone();
                // Building a client runs the kubeconfig's auth plugin, which may reach an
                // identity provider or wait for a login: named, not run.
                let plugin = auth_command(&found);
                if plugin.is_none() {
                    client_of(found).map_err(CheckError::Kubernetes)?;
                }
                let from = match from {
                    CredentialsFrom::ApiServerSetting => {
                        "source.kubernetes.api_server, no credentials"
                    }
                    CredentialsFrom::Kubeconfig => "the kubeconfig",
                    CredentialsFrom::InCluster => "the pod's service account",
                };
                let _ = writeln!(out, "  credentials: {url} ({from})");
                if let Some(plugin) = plugin {
                    let _ = writeln!(out, "  {plugin}: not run (serve runs it at start)");
                }
            }
        }
    }
    if let Some(state) = &config.replica_state {
        let store = match &state.store {
            ReplicaStateStore::Dir(dir) => format!("directory {}", dir.display()),
            ReplicaStateStore::ConfigMap { namespace, name } => {
                format!("ConfigMap {namespace}/{name}")
            }
        };
        let _ = writeln!(
            out,
            "replica state: {store}, entries count for {}",
            humantime::format_duration(state.ttl)
        );
    }
    let _ = writeln!(out, "peers: {}", config.replica_peers.len());
    out.push_str("ok\n");
    Ok(out)
}
