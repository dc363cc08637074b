//! Wiring: binds the listeners, starts every task with its channels, and stops them all
//! on one shutdown token. No logic of its own: each task lives with its module.
//!
//! Data flow (each channel has exactly one writer):
//! source → `watch<Model>` → `live::dashboards` → `watch<DashboardStates>`;
//! `live::discovery::run` joins the source's model and the dashboards into the effective
//! `watch<Model>` → `live::prober` → `watch<ProbeStates>`; `pipeline::task` joins the
//! effective model, probes and dashboards → `watch<Snapshot>` → one task per xDS stream.
//! Back-edges: the pipeline asks the dashboard poller for fresh answers (`mpsc`), and the
//! xDS server wakes the pipeline when an Envoy ACKs (`Clients::acked`).

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::admin::{AdminState, LiveViews};
use crate::config::Config;
use crate::metrics::Metrics;
use crate::pipeline::task::Sources;
use crate::supervisor::Components;
use crate::xds::Clients;

mod listeners;
mod sizing;
mod starter;

use self::listeners::Listeners;
pub use self::sizing::{
    cgroup_memory_limit, memory_limit_files, memory_needed, memory_shortfall, open_files_needed,
    open_files_shortfall, MEMORY_BASE_BYTES, OPEN_FILES_OTHER_RESERVE, OPEN_FILES_PROBE_RESERVE,
    STREAM_BYTES,
};
use self::starter::Starter;

/// A started control plane.
pub struct Running {
    pub xds_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    /// Where `/debug/*` is served, when not on `admin_addr`.
    pub admin_debug_addr: Option<SocketAddr>,
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
    metrics.count_tasks_of(tokio::runtime::Handle::current());
    let listeners = Listeners::bind(&config).await?;
    let (xds_addr, admin_addr, admin_debug_addr) = listeners.addresses()?;
    // mTLS: unreadable or mismatched files at start are fatal (there is no last good
    // configuration yet); later changes are re-read, and a bad one is only logged.
    let xds_tls = match &config.xds_tls {
        Some(files) => Some(
            crate::xds::tls::ServerTls::load(files.clone())
                .context("xds.tls: loading the xDS listener's certificate files")?,
        ),
        None => None,
    };
    let clients = Arc::new(Clients::default());
    let mut starter = Starter {
        tasks: JoinSet::new(),
        components: Arc::new(Components::new(metrics.clone())),
        shutdown: shutdown.clone(),
        metrics: metrics.clone(),
        config: &config,
    };
    let (source, source_status) = starter.source().await?;
    let dashboards = starter.dashboards(&source);
    let (models, refused) = starter.discovery(&source, &dashboards.states);
    let (probes, heartbeat) = starter.prober(&models);
    // Random per start: a replica finds itself among its peers' addresses by it.
    let replica_id = format!(
        "{:016x}",
        std::hash::BuildHasher::hash_one(&std::collections::hash_map::RandomState::new(), 0u8)
    );
    let (store, read) = starter.kept_state().await?;
    let peers = starter.peers(&replica_id, read.views);
    let loads = crate::xds::lrs::LoadReports::new(config.policies.switchover.load_report_interval);
    let sources = Sources {
        source,
        models: models.clone(),
        probes: probes.clone(),
        dashboards: dashboards.states.clone(),
        prober: heartbeat,
        peers,
        loads: loads.clone(),
    };
    let outputs = starter.pipeline(
        sources,
        dashboards.refresh,
        &source_status,
        &clients,
        &replica_id,
    );
    if let Some(store) = store {
        starter.state_keeper(store, read.taken_in, &replica_id, &outputs.switchover);
    }
    starter.xds_server(
        listeners.xds,
        xds_tls,
        outputs.snapshots,
        outputs.published.clone(),
        &clients,
        loads,
    );
    starter.spawn({
        let token = shutdown.clone();
        async move {
            crate::memory::give_back(token).await;
            Ok(())
        }
    });
    let endpoint_index = starter.endpoint_index(&outputs.published);
    let state = AdminState {
        components: starter.components.clone(),
        metrics: metrics.clone(),
        clients,
        snapshots: outputs.published,
        prestop: crate::admin::Prestop::new(
            config.replica_peers.clone(),
            replica_id.clone(),
            endpoint_index,
        ),
        live: LiveViews {
            models,
            probes,
            dashboards: dashboards.states,
            dashboards_answered: dashboards.answered,
            health: outputs.health,
            switchover: outputs.switchover,
            source: source_status,
            refused,
        },
    };
    starter.admin(listeners.admin, listeners.debug, state)?;
    tracing::info!(%xds_addr, %admin_addr, ?admin_debug_addr, tls = config.xds_tls.is_some(), "ray-xds started");
    Ok(Running {
        xds_addr,
        admin_addr,
        admin_debug_addr,
        metrics,
        shutdown,
        tasks: starter.tasks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ServeArgs;

    fn config(xds_max_connections: Option<usize>) -> Config {
        Config::load(&ServeArgs {
            source_kubernetes: true,
            xds_max_connections,
            ..Default::default()
        })
        .unwrap()
    }

    /// The open-files limit is checked against what the configured limits may
    /// hold at once: xDS connections, admin connections, probes, the rest.
    #[test]
    fn the_open_files_needed_follow_the_connection_limits() {
        let defaults = config(None);
        // 4,096 xDS + 256 admin + 1,024 probes + 64 others.
        assert_eq!(open_files_needed(&defaults), 4_096 + 256 + 1_024 + 64);
        assert_eq!(open_files_shortfall(1_024, &defaults), Some(5_440));
        assert_eq!(open_files_shortfall(5_439, &defaults), Some(5_440));
        assert_eq!(open_files_shortfall(5_440, &defaults), None);
        assert_eq!(open_files_shortfall(1_048_576, &defaults), None);
        assert_eq!(open_files_shortfall(u64::MAX, &defaults), None);
        // Lowering xds.max_connections lowers the need.
        let small = config(Some(100));
        assert_eq!(open_files_needed(&small), 100 + 256 + 1_024 + 64);
        assert_eq!(open_files_shortfall(1_024, &small), Some(1_444));
        assert_eq!(open_files_shortfall(4_096, &small), None);
    }

    /// The memory limit is read from this process's own cgroup first (v2 and v1), then
    /// from the mount roots.
    #[test]
    fn the_memory_limit_is_read_from_the_process_own_cgroup() {
        let files = |text: &str| -> Vec<String> {
            memory_limit_files(text)
                .into_iter()
                .map(|p| p.display().to_string())
                .collect()
        };
        let roots = [
            "/sys/fs/cgroup/memory.max".to_string(),
            "/sys/fs/cgroup/memory/memory.limit_in_bytes".to_string(),
        ];
        assert_eq!(
            files("0::/kubepods/pod1/c1\n")[..],
            [
                "/sys/fs/cgroup/kubepods/pod1/c1/memory.max".to_string(),
                roots[0].clone(),
                roots[1].clone()
            ]
        );
        assert_eq!(
            files("12:cpu,cpuacct:/x\n4:memory:/docker/abc\n")[0],
            "/sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes"
        );
        assert_eq!(files("0::/\n")[..], roots[..]);
        assert_eq!(files("")[..], roots[..]);
        assert_eq!(files("garbage\n0::/../../etc\n")[..], roots[..]);
    }

    /// The container's memory limit is checked against the memory budgets and the
    /// streams: the defaults (64 + 32 + 64 + 64 MiB, twice; 20,000 streams of 16 KiB)
    /// need 824.5 MiB, more than 512 MiB; fewer streams need less.
    #[test]
    fn the_memory_needed_follows_the_budgets_and_the_streams() {
        let mut c = config(None);
        let mib = 1u64 << 20;
        let streams = 20_000 * STREAM_BYTES;
        assert_eq!(memory_needed(&c), (2 * 224 + 64) * mib + streams);
        assert_eq!(memory_shortfall(1024 * mib, &c), None);
        assert_eq!(memory_shortfall(512 * mib, &c), Some(memory_needed(&c)));
        c.xds_max_streams = 4096;
        assert_eq!(memory_needed(&c), (2 * 224 + 64 + 64) * mib);
        c.memory.xds_responses = 256 * mib as usize;
        assert_eq!(memory_needed(&c), (2 * (160 + 256) + 64 + 64) * mib);
        c.memory.dashboards = 1 << 30;
        assert_eq!(
            memory_needed(&c),
            (2 * (1024 + 32 + 64 + 256) + 64 + 64) * mib
        );
        assert!(memory_shortfall(512 * mib, &c).is_some());
        c.memory.route_tables = usize::MAX;
        assert_eq!(memory_needed(&c), u64::MAX);
    }
}
