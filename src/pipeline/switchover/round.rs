//! One round of one switch (a RayService's, or one of its applications'): where it is
//! headed, and which gate holds it.
//!
//! The gates, in order: an Envoy that rejected the target holds it; before the first
//! step, an Envoy that has not warmed it holds it (until `warm_timeout`); a target that
//! is not ready holds it. A serving cluster with no routable proxy left (and none
//! awaiting a first probe) passes them: traffic moves to a target with a routable proxy.
//! A round records one [`SwitchEvent`] when the phase, weights or reason changed.

use std::time::SystemTime;

use super::judge;
use super::state::ServiceSwitch;
use super::{EnvoyWarmth, Phase, SwitchEvent, Switchover};
use crate::live::dashboards::DashboardStates;
use crate::live::health::HealthMap;
use crate::model::RayService;
use crate::pipeline::capacity::{capacity_limit, CapacityLimit, TargetSettle};
use crate::pipeline::readiness::{routed_clusters, unit_readiness, Unit};
use crate::policy::switchover::{Control, ShiftMode, SwitchoverPolicy};
use crate::policy::Value;

impl Switchover {
    /// Advances one switch (a RayService's, or one application's) keyed `key`; `serving`
    /// is where its traffic is when this replica did not know it yet.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn advance_unit(
        &mut self,
        key: &str,
        service: &RayService,
        unit: Unit<'_>,
        serving: String,
        back_to: Option<&str>,
        (known, rolled_back): (bool, bool),
        health: &HealthMap,
        dashboards: &DashboardStates,
        envoys: &dyn EnvoyWarmth,
        now: SystemTime,
        events: &mut Vec<SwitchEvent>,
    ) -> ServiceSwitch {
        let mut policy = self.defaults.with(&service.policy.overrides.switchover);
        let mut st = self.take_switch(key, serving, &policy, now);
        // A rollback works as the operator's abort (its gates included): the pending
        // cluster gets nothing, and traffic that moved there goes back.
        if rolled_back {
            policy.control = Control::Abort;
        }
        let before = (st.phase, st.weights.clone(), st.reason.clone());
        let abort = policy.control == Control::Abort;
        self.retarget(&mut st, service, back_to, abort, known, now);
        match st.target.clone() {
            None => st.stay(),
            Some(target) => {
                let inputs = RoundInputs {
                    health,
                    dashboards,
                    envoys,
                    now,
                };
                self.toward(&mut st, key, service, unit, target, &policy, &inputs);
            }
        }
        let service_key = service.key();
        st.rollback = self
            .rollback(&service_key)
            .filter(|_| rolled_back && matches!(unit, Unit::Service))
            .cloned();
        if let Some(r) = self.rollback(&service_key).filter(|_| rolled_back) {
            // Held off it, moving back from it, or just back from it. (A way back that a
            // gate holds keeps its phase and says why.)
            let returning_from = st.target.is_some() && st.serving == r.cluster;
            let back = st.phase == Phase::Aborted
                || (returning_from && st.phase == Phase::Shifting)
                || (st.target.is_none() && st.weight_of(&r.cluster) == 0);
            if returning_from && !back {
                st.reason = format!(
                    "{} is rolled back: {}; the way back waits: {}",
                    r.cluster, r.why, st.reason
                );
            } else if back {
                st.phase = Phase::RolledBack;
                let back = match st.target.as_deref() {
                    Some(t) if st.serving == r.cluster => t,
                    _ => st.serving.as_str(),
                };
                st.reason = format!(
                    "{} is rolled back: {}; traffic stays on (or returns to) {back} until a \
                     new version of it, or the operator's promote",
                    r.cluster, r.why
                );
            }
        }
        if (st.phase, &st.weights, &st.reason) != (before.0, &before.1, &before.2) {
            events.push(SwitchEvent {
                service: key.to_string(),
                phase: st.phase,
                reason: st.reason.clone(),
                weights: st.weights.clone(),
            });
        }
        st
    }

    /// The switch keyed `key` as this replica knew it, or a new one serving `serving`;
    /// what each round recomputes is reset.
    fn take_switch(
        &mut self,
        key: &str,
        serving: String,
        policy: &SwitchoverPolicy,
        now: SystemTime,
    ) -> ServiceSwitch {
        let moved_from = self.peers.moved_from(key, &serving);
        let mut st = self.services.remove(key).unwrap_or_else(|| ServiceSwitch {
            moved_from,
            serving,
            serving_since: now,
            moved: false,
            saw_begin: false,
            target: None,
            phase: Phase::Stable,
            reason: String::new(),
            weights: vec![],
            target_since: None,
            warming_since: None,
            warm_timeout: policy.warm_timeout,
            step: 0,
            shift_started: None,
            step_due: None,
            control: None,
            held_at: None,
            rollback: None,
        });
        st.warm_timeout = policy.warm_timeout;
        st.control = (policy.control != Control::Auto).then(|| policy.control.show());
        st.step_due = None;
        st
    }

    /// Where the switch is headed now: the pending cluster, back to the active cluster
    /// from the pending one when an operator aborted the switch, back to `back_to` from a
    /// pending cluster where an application failed, the active cluster when this replica
    /// serves another (an early flip, or a replaced cluster), or nowhere. A new target
    /// starts its clocks and asks for a fresh answer from its dashboard.
    fn retarget(
        &mut self,
        st: &mut ServiceSwitch,
        service: &RayService,
        back_to: Option<&str>,
        abort: bool,
        known: bool,
        now: SystemTime,
    ) {
        if service.cluster(&st.serving).is_none() {
            // The source removed the cluster we served: nothing to keep serving from.
            st.serving = service.active_cluster.clone();
            st.serving_since = now;
            st.moved = false;
            st.moved_from = None;
            st.step = 0;
            st.shift_started = None;
        }
        let previous_target = st.target.clone();
        st.target = match &service.pending_cluster {
            // Moved to the pending cluster, and the operator aborted the switch: back.
            Some(p) if *p == st.serving && abort && service.active_cluster != *p => {
                Some(service.active_cluster.clone())
            }
            // Moved on its own to a pending cluster where an application failed: back.
            Some(p) if *p == st.serving && back_to.is_some_and(|b| b != p) => {
                back_to.map(str::to_string)
            }
            // Already moved to the pending cluster: stay until the source promotes it.
            Some(p) if *p == st.serving => None,
            Some(p) => Some(p.clone()),
            // The source names an active cluster we do not serve (an early flip, or a
            // replaced cluster): a switchover like any other.
            None if service.active_cluster != st.serving => Some(service.active_cluster.clone()),
            // Moved to an early flip's cluster, and it is rolled back or the operator
            // aborted the switch: back, while the source lists the cluster it came from.
            None if abort => judge::judged_pair(service, &st.serving, st.moved_from.as_deref())
                .filter(|(new, _)| *new == st.serving)
                .map(|(_, old)| old),
            // Moved on its own to an early flip's cluster where an application failed,
            // or which is rolled back or aborted: back.
            None if back_to.is_some_and(|b| b != st.serving) => back_to.map(str::to_string),
            None => None,
        };
        if st.target != previous_target {
            st.target_since = st.target.as_ref().map(|_| now);
            st.saw_begin = known && st.target.is_some();
            st.warming_since = None;
            if let Some(t) = &st.target {
                if service.cluster(t).is_some_and(|c| c.dashboard.is_some()) {
                    self.refresh.push(service.envoy_cluster_name(t));
                }
            }
        }
    }

    /// A switch under way towards `target`: held while an Envoy rejects the target,
    /// while some Envoy has not warmed it, or while it is not ready; otherwise moved (at
    /// once, or by the progressive schedule). A serving cluster with no routable proxy
    /// left moves to a routable target past every gate but readiness of the target.
    #[allow(clippy::too_many_arguments)]
    fn toward(
        &mut self,
        st: &mut ServiceSwitch,
        key: &str,
        service: &RayService,
        unit: Unit<'_>,
        target: String,
        policy: &SwitchoverPolicy,
        inputs: &RoundInputs<'_>,
    ) {
        let RoundInputs {
            health,
            dashboards,
            envoys,
            now,
        } = *inputs;
        // Dashboard answers count from when the switch began: here, or at a peer that
        // saw it earlier (a restarted replica, mid-switch). (Only a replica that came in
        // mid-switch takes it from a peer: one that saw the switch begin knows when it
        // did.)
        let peer_since = (!st.saw_begin)
            .then(|| self.peers.target_since(key, &target))
            .flatten();
        let since = match (st.target_since, peer_since) {
            (Some(own), Some(peer)) => Some(own.min(peer)),
            (own, peer) => own.or(peer),
        };
        let min_ready = policy.min_ready_proxies;
        let ready = unit_readiness(service, &target, unit, health, dashboards, min_ready, since);
        let routable = |c: &str| health.cluster(&service.envoy_cluster_name(c)).routable > 0;
        // Proxies still awaiting their first probe (a restart, or new ones) are not known
        // to be down: no emergency move on their account, or one replica that probed the
        // target first would move to it for good.
        let awaiting = |c: &str| {
            health
                .cluster(&service.envoy_cluster_name(c))
                .awaiting_first_probe
                > 0
        };
        let desperate = !routable(&st.serving) && !awaiting(&st.serving) && routable(&target);
        if ready.is_err() {
            st.warming_since = None;
        }
        let routed = routed_clusters(service, &target, unit, health);
        // Before the first step, wait for every Envoy to warm the target.
        let (cold, warm_note) = if ready.is_ok() && !desperate && st.step == 0 {
            st.cold_envoys(&routed, envoys, policy.warm_timeout, now)
        } else {
            (Vec::new(), String::new())
        };
        let rejecting = rejecting_envoys(&routed, envoys);
        let control =
            self.effective_control(st, key, service, unit, &target, policy, desperate, inputs);
        // An abort (or a rollback) stops a move to the new cluster: the pending one, or
        // the active one an early flip named while traffic is still on another.
        let to_new = judge::judged_pair(service, &st.serving, st.moved_from.as_deref())
            .is_some_and(|(new, _)| new == target);
        let aborted = control == Control::Abort && to_new;
        // Back from an aborted pending cluster, or away from a serving cluster that is
        // not ready where the operator's word would have kept it: not a step at a time.
        let from_new =
            judge::judged_pair(service, &target, None).is_some_and(|(new, _)| new == st.serving);
        let returning = (policy.control == Control::Abort && from_new)
            || (!desperate && control != policy.control);
        if policy.control != Control::Hold {
            st.resume_after_hold(&policy.shift(), now);
        }
        match ready {
            _ if aborted => st.hold_aborted(&target),
            // (When the serving cluster has no routable proxy left and the target has,
            // traffic moves anyway: an Envoy that rejected the target keeps its own
            // route, merged for it, while every other one stops sending to a dead
            // cluster.)
            _ if !rejecting.is_empty() && !desperate => st.hold_rejected(&target, &rejecting),
            Ok(()) if !cold.is_empty() => st.hold_warming(&target, &cold),
            Err(why) if !desperate => st.hold_not_ready(&target, &why),
            _ => {
                let mut previous = st.weight_of(&target);
                // New to a hold (a restart while it stands): the share a peer, or what
                // the replicas kept, holds; within this replica's own gates and limits.
                if control == Control::Hold && st.held_at.is_none() {
                    let held = self.peers.held_at(key, &st.serving, &target);
                    previous = previous.max(held.unwrap_or(0));
                }
                let (weight, note) = self.limited_weight(
                    st, key, service, unit, &target, policy, control, returning, desperate, inputs,
                );
                if control == Control::Hold {
                    // No more than it had; less if a gate or limit says so.
                    st.hold_by_operator(target, weight.min(previous));
                } else {
                    st.shift(
                        target,
                        weight,
                        desperate,
                        &format!("{note}{warm_note}"),
                        now,
                    );
                }
            }
        }
    }

    /// The operator's word as this round takes it: none (`auto`) when the serving
    /// cluster has nothing routable left and the target has, or, under a hold or an
    /// abort, when the serving cluster is not ready (keeping traffic there would fail
    /// it: a replica that restarted while its peers had moved away from it), or, under
    /// a hold, once a peer has completed the move (it passed the same gates).
    #[allow(clippy::too_many_arguments)]
    fn effective_control(
        &self,
        st: &ServiceSwitch,
        key: &str,
        service: &RayService,
        unit: Unit<'_>,
        target: &str,
        policy: &SwitchoverPolicy,
        desperate: bool,
        inputs: &RoundInputs<'_>,
    ) -> Control {
        let control = policy.control;
        if desperate {
            return Control::Auto;
        }
        if matches!(control, Control::Auto | Control::Promote) {
            return control;
        }
        let min_ready = policy.min_ready_proxies;
        let (health, dashboards) = (inputs.health, inputs.dashboards);
        let serving = &st.serving;
        // Known, not merely unknown yet (a replica that just started has probed nothing
        // and heard no dashboard: that is no reason to pass the operator's word).
        let name = service.envoy_cluster_name(serving);
        let probed = health.cluster(&name).awaiting_first_probe == 0;
        let answered = service
            .cluster(serving)
            .is_some_and(|c| c.dashboard.is_none())
            || dashboards
                .clusters
                .get(&name)
                .is_some_and(|d| d.status.is_some() && !d.stale);
        let serving_unready = probed
            && answered
            && unit_readiness(service, serving, unit, health, dashboards, min_ready, None).is_err();
        let peer_done = control == Control::Hold && self.peers.completed(key, target);
        if serving_unready || peer_done {
            Control::Auto
        } else {
            control
        }
    }

    /// The target's percent now, once every gate passed, and a note on what bounds it:
    /// the schedule (all of it when the operator promotes, or when traffic returns from
    /// an aborted pending cluster), then the source's cap and ready capacity (not when
    /// the serving cluster has nothing routable left, nor after a peer completed the
    /// move: it passed the same gates and limits; capacity not when the operator
    /// promotes).
    #[allow(clippy::too_many_arguments)]
    fn limited_weight(
        &self,
        st: &mut ServiceSwitch,
        key: &str,
        service: &RayService,
        unit: Unit<'_>,
        target: &str,
        policy: &SwitchoverPolicy,
        control: Control,
        returning: bool,
        desperate: bool,
        inputs: &RoundInputs<'_>,
    ) -> (u32, String) {
        let promoted = control == Control::Promote;
        // (A hold bounds the weight by what it was: the schedule has nothing to add.)
        let scheduled = if promoted || returning || control == Control::Hold {
            100
        } else {
            self.shift_weight(st, key, target, policy, desperate, inputs.now)
        };
        let previous = st.weight_of(target);
        let limit = (!desperate && !self.peers.completed(key, target))
            .then(|| {
                let by_source = source_cap(service, target);
                let by_capacity = (!promoted)
                    .then(|| {
                        capacity_limit(
                            service,
                            unit,
                            &st.serving,
                            target,
                            previous,
                            inputs.dashboards,
                            &TargetSettle {
                                settle: &self.settle,
                                duration: policy.capacity_settle,
                                now: inputs.now,
                            },
                        )
                    })
                    .flatten();
                by_source
                    .into_iter()
                    .chain(by_capacity)
                    .min_by_key(|l| l.weight)
            })
            .flatten()
            .filter(|limit| limit.weight < scheduled);
        let promote_note = if promoted {
            " (promoted by the operator)"
        } else {
            ""
        };
        if let (Some(limit), false) = (&limit, promoted || returning || desperate) {
            hold_schedule_at(st, &policy.shift(), limit.weight, inputs.now);
        }
        match limit {
            Some(limit) => (
                limit.weight,
                format!("{promote_note} (held by {})", limit.why),
            ),
            None => (scheduled, promote_note.to_string()),
        }
    }
}

/// A progressive schedule bounds the rate of change, not the weight: while a limit (ready
/// capacity, the source's cap) holds the target below the schedule's step, the schedule
/// waits at its first step at or above the limited weight (its start moves up to `now`
/// less that many intervals, never back). So when the limit lifts, the weight rises to
/// that step at most, and one step per interval after, as it would have from there.
fn hold_schedule_at(st: &mut ServiceSwitch, shift: &ShiftMode, weight: u32, now: SystemTime) {
    let ShiftMode::Progressive { steps, interval } = shift else {
        return;
    };
    let Some(started) = st.shift_started else {
        return;
    };
    let waiting_at = steps
        .iter()
        .position(|s| *s >= weight)
        .unwrap_or(steps.len().saturating_sub(1));
    let start = now
        .checked_sub(*interval * waiting_at as u32)
        .unwrap_or(started)
        .max(started);
    st.shift_started = Some(start);
    st.step = waiting_at + 1;
    st.step_due = Some(start + *interval * st.step as u32);
}

/// What a round of the switchover reads besides the model.
#[derive(Clone, Copy)]
struct RoundInputs<'a> {
    health: &'a HealthMap,
    dashboards: &'a DashboardStates,
    envoys: &'a dyn EnvoyWarmth,
    now: SystemTime,
}

/// The source's cap on the pending cluster's traffic (KubeRay's incremental upgrade),
/// when `target` is the pending cluster.
fn source_cap(service: &RayService, target: &str) -> Option<CapacityLimit> {
    let cap = service.pending_traffic_cap?;
    (service.pending_cluster.as_deref() == Some(target)).then(|| CapacityLimit {
        weight: cap,
        why: format!("the source: it routes {cap}% to {target}"),
    })
}

/// Connected Envoys that rejected any of `routed`, each once.
fn rejecting_envoys(routed: &[String], envoys: &dyn EnvoyWarmth) -> Vec<String> {
    let mut rejecting = Vec::new();
    for name in routed {
        for envoy in envoys.rejecting_envoys(name) {
            if !rejecting.contains(&envoy) {
                rejecting.push(envoy);
            }
        }
    }
    rejecting
}
