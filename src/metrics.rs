//! Prometheus metrics, served on the admin port's `/metrics`.
//!
//! One [`Metrics`] is shared by every part; label sets are small and fixed (protocol,
//! xDS type, source), never per-client or per-resource, so cardinality stays bounded. The
//! one per-object family, `switchover_weight{rayservice,cluster}`, holds only clusters
//! that exist: the pipeline removes a series when its cluster goes.

use std::sync::Mutex;
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::xds::ResourceType;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProtocolLabels {
    pub protocol: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TypeLabels {
    pub protocol: &'static str,
    pub r#type: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabels {
    pub source: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ObjectProblemLabels {
    pub source: &'static str,
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResourceLabels {
    pub resource: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub protocol: &'static str,
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StoreLabels {
    pub op: &'static str,
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabels {
    pub state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct WeightLabels {
    pub rayservice: String,
    pub cluster: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WhatLabels {
    pub what: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct VersionLabels {
    pub version: String,
}

pub struct Metrics {
    registry: Registry,
    pub streams: Family<ProtocolLabels, Gauge>,
    pub subscriptions: Family<TypeLabels, Gauge>,
    pub pushes: Family<TypeLabels, Counter>,
    pub pushed_resources: Family<TypeLabels, Counter>,
    pub acks: Family<TypeLabels, Counter>,
    pub nacks: Family<TypeLabels, Counter>,
    pub stream_errors: Family<ReasonLabels, Counter>,
    pub tls_reloads: Family<ResultLabels, Counter>,
    pub load_streams: Gauge,
    pub load_report_clusters: Family<ResultLabels, Counter>,
    pub prestop_calls: Family<ResultLabels, Counter>,
    /// Reads and writes of the replicas' kept switchover views (`replicas.state`).
    pub state_store_ops: Family<StoreLabels, Counter>,
    pub snapshots: Counter,
    pub snapshot_resources: Gauge,
    snapshot_info: Family<VersionLabels, Gauge>,
    current_version: Mutex<String>,
    pub translate_seconds: Histogram,
    pub source_rejected: Family<SourceLabels, Counter>,
    pub source_updates: Family<SourceLabels, Counter>,
    pub probe_seconds: Histogram,
    pub health_transitions: Family<StateLabels, Counter>,
    pub dashboard_errors: Family<ErrorLabels, Counter>,
    pub fail_open_events: Counter,
    pub fail_open_clusters: Gauge,
    pub switchover_weight: Family<WeightLabels, Gauge>,
    pub switchover_transitions: Family<StateLabels, Counter>,
    /// RayServices whose switch is in each phase now (every phase, zeros too).
    pub switchovers: Family<StateLabels, Gauge>,
    /// RayServices under each operator's word (`switchover.control` other than `auto`).
    pub switchover_controls: Family<StateLabels, Gauge>,
    pub source_objects_skipped: Family<ObjectProblemLabels, Counter>,
    pub source_watch_errors: Family<ResourceLabels, Counter>,
    pub source_synced: Gauge,
    pub inconsistent_snapshots: Counter,
    pub proxies_refused: Family<ErrorLabels, Gauge>,
    pub runtime_tasks: Gauge,
    /// Route tables (`/-/routes`) refused or dropped by the routes' memory budget.
    pub routes_refused: Counter,
    /// What outside answers hold now, as the memory budgets count it, by `what`
    /// (`dashboards`, `routes`).
    pub held_bytes: Family<WhatLabels, Gauge>,
    /// The runtime whose tasks `runtime_tasks` counts (the main one: the admin port,
    /// which renders the metrics, runs on a runtime of its own).
    counted_runtime: std::sync::OnceLock<tokio::runtime::Handle>,
    /// The xDS server's bound on response bytes, read when scraped.
    response_bytes: std::sync::OnceLock<crate::xds::responses::ResponseBytes>,
    pub xds_response_bytes: Gauge,
    pub xds_responses_waiting: Gauge,
    pub component_restarts: Family<ComponentLabels, Counter>,
    pub component_up: Family<ComponentLabels, Gauge>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ComponentLabels {
    pub component: &'static str,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut m = Metrics {
            streams: Family::default(),
            subscriptions: Family::default(),
            pushes: Family::default(),
            pushed_resources: Family::default(),
            acks: Family::default(),
            nacks: Family::default(),
            stream_errors: Family::default(),
            tls_reloads: Family::default(),
            load_streams: Gauge::default(),
            load_report_clusters: Family::default(),
            prestop_calls: Family::default(),
            state_store_ops: Family::default(),
            snapshots: Counter::default(),
            snapshot_resources: Gauge::default(),
            snapshot_info: Family::default(),
            current_version: Mutex::new(String::new()),
            translate_seconds: Histogram::new(exponential_buckets(0.000_01, 4.0, 10)),
            source_rejected: Family::default(),
            source_updates: Family::default(),
            probe_seconds: Histogram::new(exponential_buckets(0.000_1, 2.5, 12)),
            health_transitions: Family::default(),
            dashboard_errors: Family::default(),
            fail_open_events: Counter::default(),
            fail_open_clusters: Gauge::default(),
            switchover_weight: Family::default(),
            switchover_transitions: Family::default(),
            switchovers: Family::default(),
            switchover_controls: Family::default(),
            source_objects_skipped: Family::default(),
            source_watch_errors: Family::default(),
            source_synced: Gauge::default(),
            inconsistent_snapshots: Counter::default(),
            proxies_refused: Family::default(),
            runtime_tasks: Gauge::default(),
            routes_refused: Counter::default(),
            held_bytes: Family::default(),
            counted_runtime: std::sync::OnceLock::new(),
            response_bytes: std::sync::OnceLock::new(),
            xds_response_bytes: Gauge::default(),
            xds_responses_waiting: Gauge::default(),
            component_restarts: Family::default(),
            component_up: Family::default(),
            registry: Registry::with_prefix("ray_xds"),
        };
        m.register_xds();
        m.register_snapshots();
        m.register_source();
        m.register_live();
        m.register_switchover();
        m.register_components();
        m.set_held_bytes("dashboards", 0);
        m.set_held_bytes("routes", 0);
        m
    }

    /// Registers the metrics of the xDS server: streams, subscriptions, pushes, ACKs and NACKs, stream errors, TLS reloads.
    fn register_xds(&mut self) {
        let registry = &mut self.registry;
        registry.register("xds_streams", "Connected ADS streams", self.streams.clone());
        registry.register(
            "xds_subscriptions",
            "Connected ADS streams subscribed to each resource type",
            self.subscriptions.clone(),
        );
        registry.register(
            "xds_pushes",
            "Discovery responses sent",
            self.pushes.clone(),
        );
        registry.register(
            "xds_pushed_resources",
            "Resources carried by discovery responses",
            self.pushed_resources.clone(),
        );
        registry.register(
            "xds_acks",
            "Responses the client accepted",
            self.acks.clone(),
        );
        registry.register(
            "xds_nacks",
            "Responses the client rejected",
            self.nacks.clone(),
        );
        // At 0 from the start, every protocol and type: a series born at its first NACK
        // shows no increase() in Prometheus, and an alert on it would never fire.
        for protocol in ["sotw", "delta"] {
            for ty in ["cds", "eds", "lds", "rds"] {
                let _ = self.acks.get_or_create(&Metrics::type_labels(protocol, ty));
                let _ = self
                    .nacks
                    .get_or_create(&Metrics::type_labels(protocol, ty));
            }
        }
        registry.register(
            "xds_stream_errors",
            "Streams ended by a client error (bad message, unknown type, too large)",
            self.stream_errors.clone(),
        );
        registry.register(
            "xds_tls_reloads",
            "Changes of the xDS listener's certificate files: loaded (ok) or unusable and the last good ones kept (error)",
            self.tls_reloads.clone(),
        );
        registry.register(
            "load_streams",
            "Envoys' load reporting streams open (Load Reporting Service)",
            self.load_streams.clone(),
        );
        registry.register(
            "load_report_clusters",
            "Cluster entries of Envoys' load reports: counted for a switch (tracked), skipped (untracked), or refused: no ADS stream of the reporting node takes the cluster (not_held)",
            self.load_report_clusters.clone(),
        );
        registry.register(
            "prestop_calls",
            "Pre-stop handshakes answered (GET /prestop), by result: dropped (every Envoy holds endpoints without the address), grace (the grace passed first), busy (too many waiting)",
            self.prestop_calls.clone(),
        );
        for result in ["dropped", "grace", "busy"] {
            let _ = self.prestop_calls.get_or_create(&ResultLabels { result });
        }
        registry.register(
            "state_store_ops",
            "Reads (at start) and writes of this replica's kept switchover view (replicas.state), by result",
            self.state_store_ops.clone(),
        );
    }

    /// Registers the metrics of the pipeline's snapshots and the time to translate them.
    fn register_snapshots(&mut self) {
        let registry = &mut self.registry;
        registry.register("snapshots", "Snapshots published", self.snapshots.clone());
        registry.register(
            "snapshot_resources",
            "Resources in the current snapshot",
            self.snapshot_resources.clone(),
        );
        registry.register(
            "snapshot_info",
            "The current snapshot's version (a content hash) as a label",
            self.snapshot_info.clone(),
        );
        registry.register(
            "translate_seconds",
            "Time to translate the model into Envoy resources",
            self.translate_seconds.clone(),
        );
        registry.register(
            "inconsistent_snapshots",
            "Snapshots refused because their resources did not fit together (a bug); the previous one was kept",
            self.inconsistent_snapshots.clone(),
        );
    }

    /// Registers the metrics of the source: refused inputs, models published, skipped objects, watches.
    fn register_source(&mut self) {
        let registry = &mut self.registry;
        registry.register(
            "source_rejected",
            "Source inputs refused (unreadable, malformed or invalid); the last good state was kept",
            self.source_rejected.clone(),
        );
        registry.register(
            "source_updates",
            "Valid new models published by a source",
            self.source_updates.clone(),
        );
        registry.register(
            "source_objects_skipped",
            "Objects (or parts of them, such as an annotation) a source ignored, by reason; counted once per new problem",
            self.source_objects_skipped.clone(),
        );
        registry.register(
            "source_watch_errors",
            "Kubernetes watch failures (retried with back-off; the last state is kept)",
            self.source_watch_errors.clone(),
        );
        registry.register(
            "source_synced",
            "1 once every watch of the source has delivered its first full list",
            self.source_synced.clone(),
        );
    }

    /// Registers the metrics of live health: probes, health changes, dashboard polls, fail-open, what outside answers hold, refused proxies.
    fn register_live(&mut self) {
        let registry = &mut self.registry;
        registry.register(
            "probe_duration_seconds",
            "Time a proxy health probe took (GET /-/healthz)",
            self.probe_seconds.clone(),
        );
        registry.register(
            "proxy_health_transitions",
            "Proxy probe-state changes, by the state entered",
            self.health_transitions.clone(),
        );
        registry.register(
            "dashboard_poll_errors",
            "Failed polls of a Ray dashboard (the last known state is kept)",
            self.dashboard_errors.clone(),
        );
        registry.register(
            "fail_open_events",
            "Times a cluster with every proxy failing its probes was published healthy",
            self.fail_open_events.clone(),
        );
        registry.register(
            "fail_open_clusters",
            "Clusters currently published fail-open",
            self.fail_open_clusters.clone(),
        );
        registry.register(
            "probe_routes_refused",
            "Route tables (GET /-/routes) refused or dropped as over their cluster's fair share of the routes' memory budget; those proxies' routes are unknown",
            self.routes_refused.clone(),
        );
        registry.register(
            "held_bytes",
            "What outside answers hold now (estimated, as the memory budgets count it), by what: dashboards or routes",
            self.held_bytes.clone(),
        );
        registry.register(
            "proxies_refused",
            "Proxies left out by the address policy now (never a proxy's address, outside proxies.networks, or discovered outside their dashboard's network), by reason",
            self.proxies_refused.clone(),
        );
    }

    /// Registers the metrics of switchovers: weights and phase changes.
    fn register_switchover(&mut self) {
        let registry = &mut self.registry;
        registry.register(
            "switchover_weight",
            "Percent of a RayService's traffic each of its clusters gets",
            self.switchover_weight.clone(),
        );
        registry.register(
            "switchover_transitions",
            "Switchover state changes, by the phase entered",
            self.switchover_transitions.clone(),
        );
        registry.register(
            "switchovers",
            "RayServices whose switchover is in each phase now (held and aborted: an operator's word)",
            self.switchovers.clone(),
        );
        registry.register(
            "switchover_controls",
            "RayServices under each operator's word (switchover.control: hold, promote, abort), whatever their phase",
            self.switchover_controls.clone(),
        );
    }

    /// Registers the metrics of the runtime and the supervisor's components.
    fn register_components(&mut self) {
        let registry = &mut self.registry;
        registry.register(
            "xds_response_bytes",
            "Bytes of ADS responses built and not yet written, as memory.xds_responses counts them, when /metrics was read",
            self.xds_response_bytes.clone(),
        );
        registry.register(
            "xds_responses_waiting",
            "ADS streams waiting for room under memory.xds_responses to build their responses, when /metrics was read",
            self.xds_responses_waiting.clone(),
        );
        registry.register(
            "runtime_alive_tasks",
            "Tasks alive in the async runtime when /metrics was read",
            self.runtime_tasks.clone(),
        );
        registry.register(
            "component_restarts",
            "Times a component (source, dashboards, discovery, prober, pipeline) stopped on a panic or error and was restarted",
            self.component_restarts.clone(),
        );
        registry.register(
            "component_up",
            "1 while a component is running, 0 while it is down (between a failure and its restart)",
            self.component_up.clone(),
        );
    }

    /// The proxies the address policy refuses now, by reason label (every label of
    /// [`AddressRefusal`](crate::model::AddressRefusal) is set, to 0 when none).
    pub(crate) fn set_refused_proxies(&self, labels: impl Iterator<Item = &'static str>) {
        let mut counts: std::collections::BTreeMap<&'static str, i64> =
            crate::model::AddressRefusal::LABELS
                .into_iter()
                .map(|l| (l, 0))
                .collect();
        for l in labels {
            *counts.entry(l).or_default() += 1;
        }
        for (reason, n) in counts {
            self.proxies_refused
                .get_or_create(&ErrorLabels { reason })
                .set(n);
        }
    }

    /// Sets what `what` (`dashboards` or `routes`) holds now.
    pub(crate) fn set_held_bytes(&self, what: &'static str, bytes: usize) {
        self.held_bytes
            .get_or_create(&WhatLabels { what })
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    pub(crate) fn source_rejected(&self, source: &'static str) {
        self.source_rejected
            .get_or_create(&SourceLabels { source })
            .inc();
    }

    pub(crate) fn type_labels(protocol: &'static str, ty: &'static str) -> TypeLabels {
        TypeLabels {
            protocol,
            r#type: ty,
        }
    }

    pub(crate) fn set_snapshot_version(&self, version: &str) {
        let mut current = self
            .current_version
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if !current.is_empty() {
            self.snapshot_info.remove(&VersionLabels {
                version: current.clone(),
            });
        }
        self.snapshot_info
            .get_or_create(&VersionLabels {
                version: version.to_string(),
            })
            .set(1);
        *current = version.to_string();
    }

    /// Counts the tasks of `runtime` in `ray_xds_runtime_alive_tasks` (the first one
    /// named wins).
    pub(crate) fn count_tasks_of(&self, runtime: tokio::runtime::Handle) {
        let _ = self.counted_runtime.set(runtime);
    }

    /// Reports `bound` in `ray_xds_xds_response_bytes` and `…_responses_waiting` (the
    /// first one named wins).
    pub(crate) fn count_responses_of(&self, bound: crate::xds::responses::ResponseBytes) {
        let _ = self.response_bytes.set(bound);
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        if let Some(bound) = self.response_bytes.get() {
            self.xds_response_bytes
                .set(i64::try_from(bound.total()).unwrap_or(i64::MAX));
            self.xds_responses_waiting
                .set(i64::try_from(bound.waiting()).unwrap_or(i64::MAX));
        }
        // The runtime's live tasks, read when scraped (a leak of tasks shows as growth).
        let current = tokio::runtime::Handle::try_current().ok();
        if let Some(handle) = self.counted_runtime.get().or(current.as_ref()) {
            self.runtime_tasks
                .set(handle.metrics().num_alive_tasks() as i64);
        }
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// The xDS server's reports, counted.
impl crate::xds::Observer for Metrics {
    fn stream_opened(&self, protocol: &'static str) {
        self.streams
            .get_or_create(&ProtocolLabels { protocol })
            .inc();
    }

    fn stream_closed(&self, protocol: &'static str) {
        self.streams
            .get_or_create(&ProtocolLabels { protocol })
            .dec();
    }

    fn subscribed(&self, protocol: &'static str, ty: ResourceType) {
        self.subscriptions
            .get_or_create(&Metrics::type_labels(protocol, ty.label()))
            .inc();
    }

    fn unsubscribed(&self, protocol: &'static str, ty: ResourceType) {
        self.subscriptions
            .get_or_create(&Metrics::type_labels(protocol, ty.label()))
            .dec();
    }

    fn pushed(&self, protocol: &'static str, ty: ResourceType, resources: usize) {
        let labels = Metrics::type_labels(protocol, ty.label());
        self.pushes.get_or_create(&labels).inc();
        self.pushed_resources
            .get_or_create(&labels)
            .inc_by(resources as u64);
    }

    fn acked(&self, protocol: &'static str, ty: ResourceType) {
        self.acks
            .get_or_create(&Metrics::type_labels(protocol, ty.label()))
            .inc();
    }

    fn nacked(&self, protocol: &'static str, ty: ResourceType) {
        self.nacks
            .get_or_create(&Metrics::type_labels(protocol, ty.label()))
            .inc();
    }

    fn stream_error(&self, protocol: &'static str, reason: &'static str) {
        self.stream_errors
            .get_or_create(&ReasonLabels { protocol, reason })
            .inc();
    }

    fn load_stream(&self, opened: bool) {
        if opened {
            self.load_streams.inc();
        } else {
            self.load_streams.dec();
        }
    }

    fn load_report(&self, recorded: &crate::xds::lrs::Recorded) {
        for (result, n) in [
            ("tracked", recorded.tracked),
            ("untracked", recorded.untracked),
            ("not_held", recorded.not_held),
        ] {
            self.load_report_clusters
                .get_or_create(&ResultLabels { result })
                .inc_by(n as u64);
        }
    }

    fn load_report_refused(&self, reason: &'static str) {
        self.stream_errors
            .get_or_create(&ReasonLabels {
                protocol: "lrs",
                reason,
            })
            .inc();
    }

    fn tls_reload(&self, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.tls_reloads
            .get_or_create(&ResultLabels { result })
            .inc();
    }
}

/// The CPU time the calling thread has used: for debug logs that tell a step's own work
/// from its wait for a core.
pub(crate) fn thread_cpu_time() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(
        t.tv_sec.max(0) as u64,
        t.tv_nsec.clamp(0, 999_999_999) as u32,
    )
}
