//! Wiring: binds the listeners, starts the source, the pipeline, the xDS server and the
//! admin server, and stops them all on one shutdown token.
//!
//! Data flow: source → `watch<Model>` → pipeline (translate, snapshot) →
//! `watch<Snapshot>` → one task per xDS stream. Each channel has exactly one writer.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::admin::{self, AdminState};
use crate::config::{Config, GatewaySettings, SourceConfig};
use crate::metrics::{Metrics, SourceLabels};
use crate::model::Model;
use crate::source::file::{self, FileSource};
use crate::translate::translate;
use crate::xds::grpc::AdsService;
use crate::xds::server::{AdsServer, Clients};
use crate::xds::Snapshot;

/// A started control plane.
pub struct Running {
    pub xds_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub metrics: Arc<Metrics>,
    shutdown: CancellationToken,
    tasks: JoinSet<anyhow::Result<()>>,
}

impl Running {
    /// Stops everything and waits for it.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        while let Some(result) = self.tasks.join_next().await {
            result??;
        }
        Ok(())
    }

    /// Waits until a part fails or `shutdown` fires.
    pub async fn wait(mut self) -> anyhow::Result<()> {
        tokio::select! {
            _ = self.shutdown.cancelled() => {}
            done = self.tasks.join_next() => match done {
                Some(Ok(Ok(()))) | None if !self.shutdown.is_cancelled() => {
                    self.shutdown.cancel();
                    anyhow::bail!("a component stopped unexpectedly")
                }
                Some(Ok(Err(e))) => {
                    self.shutdown.cancel();
                    return Err(e);
                }
                Some(Err(e)) => {
                    self.shutdown.cancel();
                    return Err(e.into());
                }
                _ => {}
            }
        }
        self.stop().await
    }
}

/// Starts ray-xds. A bad source file at start is an error; later bad edits are not.
pub async fn start(config: Config, shutdown: CancellationToken) -> anyhow::Result<Running> {
    let metrics = Arc::new(Metrics::new());
    let clients = Arc::new(Clients::default());
    let xds_listener = TcpListener::bind(config.xds_listen)
        .await
        .with_context(|| format!("binding the xDS listener on {}", config.xds_listen))?;
    let admin_listener = TcpListener::bind(config.admin_listen)
        .await
        .with_context(|| format!("binding the admin listener on {}", config.admin_listen))?;
    let xds_addr = xds_listener.local_addr()?;
    let admin_addr = admin_listener.local_addr()?;

    let mut tasks = JoinSet::new();
    let (models_tx, models_rx) = match &config.source {
        SourceConfig::File {
            path,
            poll_interval,
        } => {
            let (model, bytes) = file::load(path)?;
            let (tx, rx) = watch::channel(Arc::new(model));
            let source = FileSource {
                path: path.clone(),
                poll_interval: *poll_interval,
                metrics: metrics.clone(),
            };
            let token = shutdown.clone();
            let sender = tx.clone();
            tasks.spawn(async move {
                source.run(bytes, sender, token).await;
                Ok(())
            });
            (tx, rx)
        }
    };
    // The source task owns the writer; keep ours only so the channel outlives it.
    let _ = models_tx;

    let (published_tx, published_rx) = watch::channel::<Option<Arc<Snapshot>>>(None);
    let first = build_snapshot(&models_rx.borrow(), &config.gateway, &metrics, None);
    let (snapshots_tx, snapshots_rx) = watch::channel(first.clone());
    published_tx.send_replace(Some(first));
    {
        let gateway = config.gateway.clone();
        let metrics = metrics.clone();
        let token = shutdown.clone();
        tasks.spawn(async move {
            run_pipeline(
                models_rx,
                gateway,
                metrics,
                snapshots_tx,
                published_tx,
                token,
            )
            .await;
            Ok(())
        });
    }

    let ads = AdsServer::new(
        snapshots_rx,
        metrics.clone(),
        clients.clone(),
        shutdown.clone(),
    );
    {
        let service = AdsService::new(ads, config.xds_max_message_bytes);
        let token = shutdown.clone();
        tasks.spawn(async move {
            tonic::transport::Server::builder()
                .http2_keepalive_interval(Some(std::time::Duration::from_secs(30)))
                .add_service(service)
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::TcpListenerStream::new(xds_listener),
                    token.cancelled_owned(),
                )
                .await
                .context("xDS server")
        });
    }
    {
        let state = AdminState {
            metrics: metrics.clone(),
            clients,
            snapshots: published_rx,
        };
        let token = shutdown.clone();
        tasks.spawn(async move {
            admin::serve(admin_listener, state, token)
                .await
                .context("admin server")
        });
    }
    tracing::info!(%xds_addr, %admin_addr, "ray-xds started");
    Ok(Running {
        xds_addr,
        admin_addr,
        metrics,
        shutdown,
        tasks,
    })
}

fn build_snapshot(
    model: &Model,
    gateway: &GatewaySettings,
    metrics: &Metrics,
    previous: Option<&Snapshot>,
) -> Arc<Snapshot> {
    let started = Instant::now();
    let snapshot = Snapshot::from_resources_reusing(&translate(model, gateway), previous);
    metrics
        .translate_seconds
        .observe(started.elapsed().as_secs_f64());
    metrics.snapshots.inc();
    metrics.snapshot_resources.set(snapshot.len() as i64);
    metrics.set_snapshot_version(snapshot.version());
    tracing::info!(
        version = snapshot.version(),
        resources = snapshot.len(),
        "snapshot built"
    );
    Arc::new(snapshot)
}

/// The single writer of the snapshot channel: rebuilds on every model change and
/// publishes only when the version changes.
async fn run_pipeline(
    mut models: watch::Receiver<Arc<Model>>,
    gateway: GatewaySettings,
    metrics: Arc<Metrics>,
    snapshots: watch::Sender<Arc<Snapshot>>,
    published: watch::Sender<Option<Arc<Snapshot>>>,
    shutdown: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            changed = models.changed() => if changed.is_err() { return },
        }
        metrics
            .source_updates
            .get_or_create(&SourceLabels { source: "file" })
            .inc();
        let model = models.borrow_and_update().clone();
        let previous = snapshots.borrow().clone();
        let snapshot = build_snapshot(&model, &gateway, &metrics, Some(&previous));
        let changed = snapshots.send_if_modified(|current| {
            if current.version() == snapshot.version() {
                false
            } else {
                *current = snapshot.clone();
                true
            }
        });
        if changed {
            published.send_replace(Some(snapshot));
        }
    }
}
