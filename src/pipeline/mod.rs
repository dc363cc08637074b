//! The pipeline: from what ray-xds knows (the effective model, probe states, dashboards,
//! the Envoys' warmth) to the snapshot Envoy gets. Pure: [`Pipeline::build`] takes its
//! inputs and the time, and returns the snapshot, what it decided and when time alone
//! would change the answer ([`Output::wake_at`]); [`task`] is the thin loop that feeds it
//! from channels and publishes what it returns.
//!
//! One build, in order:
//! 1. clusters the source dropped stay, draining, for their grace period ([`departed`]);
//! 2. proxies new since the last snapshot are withheld until their first probe (at most
//!    the probe policy's first-probe wait): Envoy would count them healthy while unknown;
//! 3. `live::health` decides every endpoint's health (the one authority);
//! 4. the [`switchover`] advances each RayService's weights, reading that health;
//! 5. `translate` builds the Envoy resources, and `xds` encodes them into a snapshot,
//!    refusing one that is inconsistent (then the previous one stays).
//!
//! Invariants: state carried between builds (switchover, departed clusters, what was
//! published) changes only here; nothing here reads a clock or does I/O.

pub mod departed;
pub mod switchover;
pub mod task;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::SystemTime;

use crate::config::GatewaySettings;
use crate::live::dashboards::DashboardStates;
use crate::live::health::{assess, Facts, HealthMap};
use crate::live::probe::ProbeState;
use crate::live::prober::ProbeStates;
use crate::model::Model;
use crate::policy::Policies;
use crate::translate::translate;
use crate::xds::Snapshot;

use self::departed::Departed;
use self::switchover::{EnvoyWarmth, SwitchEvent, Switchover};

/// What one build reads.
pub struct Inputs<'a> {
    /// The effective model: the source's, with discovered proxies.
    pub model: &'a Arc<Model>,
    pub probes: &'a ProbeStates,
    pub dashboards: &'a DashboardStates,
    /// Which connected Envoys have warmed which clusters.
    pub envoys: &'a dyn EnvoyWarmth,
}

/// Something a build decided that is worth a log line and a metric.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    Switch(SwitchEvent),
    FailOpenStarted(String),
    FailOpenEnded(String),
    /// Translation gave resources that do not fit together (a bug): not published.
    Inconsistent(String),
}

/// What one build gives.
pub struct Output {
    /// The snapshot to serve (the previous one when this build's was refused).
    pub snapshot: Arc<Snapshot>,
    pub health: Arc<HealthMap>,
    pub switchover: Arc<Switchover>,
    pub events: Vec<Event>,
    /// Envoy clusters whose dashboard should be asked again now.
    pub refresh: Vec<String>,
    /// When time alone changes the answer: build again then, even without new input.
    pub wake_at: Option<SystemTime>,
    /// Build again when an Envoy ACKs clusters or endpoints (a switch waits for warmth).
    pub wake_on_ack: bool,
}

/// The pipeline's state between builds.
pub struct Pipeline {
    policies: Policies,
    gateway: GatewaySettings,
    switchover: Switchover,
    departed: Departed,
    /// Proxies the last snapshot had.
    published: BTreeSet<SocketAddr>,
    last_source: Arc<Model>,
    fail_open: BTreeSet<String>,
    last: Option<Arc<Snapshot>>,
}

impl Pipeline {
    pub fn new(policies: Policies, gateway: GatewaySettings) -> Pipeline {
        Pipeline {
            switchover: Switchover::new(policies.switchover.clone()),
            policies,
            gateway,
            departed: Departed::default(),
            published: BTreeSet::new(),
            last_source: Arc::new(Model::default()),
            fail_open: BTreeSet::new(),
            last: None,
        }
    }

    /// When the proxies of `model` that the last snapshot lacks stop waiting for their
    /// first probe; `None` when none waits. A caller that just saw the model change may
    /// wait (for probes, at most until then) so that the change goes out once, with
    /// health, instead of twice.
    pub fn first_probes_due(
        &self,
        model: &Model,
        probes: &ProbeStates,
        now: SystemTime,
    ) -> Option<SystemTime> {
        self.awaiting_first_probe(model, probes, now)
            .map(|(_, until)| until)
            .max()
    }

    /// New proxies without a first probe, each with when it stops waiting (in the future).
    fn awaiting_first_probe<'a>(
        &'a self,
        model: &'a Model,
        probes: &'a ProbeStates,
        now: SystemTime,
    ) -> impl Iterator<Item = (SocketAddr, SystemTime)> + 'a {
        let wait = self.policies.probe.first_probe_wait();
        model
            .proxies()
            .map(|p| p.address)
            .filter(|a| !self.published.contains(a))
            .filter_map(move |address| {
                let until = match probes.proxies.get(&address) {
                    Some(p) if p.state != ProbeState::Unknown => return None,
                    Some(p) => p.since + wait,
                    None => now + wait,
                };
                (until > now).then_some((address, until))
            })
    }

    pub fn build(&mut self, inputs: &Inputs<'_>, now: SystemTime) -> Output {
        let source = inputs.model;
        let model = self
            .departed
            .update(&self.last_source, source, &self.policies.switchover, now);
        self.last_source = source.clone();

        let awaiting: Vec<(SocketAddr, SystemTime)> = self
            .awaiting_first_probe(&model, inputs.probes, now)
            .collect();
        let withheld: BTreeSet<SocketAddr> = awaiting.iter().map(|(a, _)| *a).collect();
        let departed = self.departed.envoy_cluster_names();
        let health = assess(
            &model,
            inputs.probes,
            inputs.dashboards,
            Facts {
                withheld: Some(&withheld),
                departed: Some(&departed),
            },
        );
        self.published = model
            .proxies()
            .map(|p| p.address)
            .filter(|a| !withheld.contains(a))
            .collect();

        let mut events: Vec<Event> = self
            .switchover
            .advance(source, &health, inputs.dashboards, inputs.envoys, now)
            .into_iter()
            .map(Event::Switch)
            .collect();
        let refresh = self.switchover.take_refresh_requests();

        let fail_open: BTreeSet<String> =
            health.fail_open().into_iter().map(str::to_string).collect();
        events.extend(
            fail_open
                .difference(&self.fail_open)
                .cloned()
                .map(Event::FailOpenStarted),
        );
        events.extend(
            self.fail_open
                .difference(&fail_open)
                .cloned()
                .map(Event::FailOpenEnded),
        );
        self.fail_open = fail_open;

        let resources = translate(
            &model,
            &health,
            &self.switchover.weights(),
            &self.gateway,
            &self.policies.traffic,
        );
        let snapshot = match Snapshot::build(&resources, self.last.as_deref()) {
            Ok(s) => Arc::new(s),
            Err(why) => {
                events.push(Event::Inconsistent(why.to_string()));
                self.last
                    .clone()
                    .unwrap_or_else(|| Arc::new(Snapshot::default()))
            }
        };
        self.last = Some(snapshot.clone());

        let wake_at = [
            self.switchover.next_wake(),
            awaiting.iter().map(|(_, until)| *until).min(),
            self.departed.next_expiry(),
        ]
        .into_iter()
        .flatten()
        .min();
        Output {
            snapshot,
            health: Arc::new(health),
            switchover: Arc::new(self.switchover.clone()),
            events,
            refresh,
            wake_at,
            wake_on_ack: self.switchover.warming(),
        }
    }
}
