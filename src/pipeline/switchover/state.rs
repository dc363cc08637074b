//! One switch's state (a RayService's, or one of its applications'): where its traffic
//! is, where it is headed, and the phase it is in, with the transitions a round makes.
//!
//! Each transition sets the weights whole: while held (rejected, warming, not ready) all
//! traffic is on the serving cluster; while shifting, the target's percent and the
//! rest on the serving cluster; at 100 the target becomes the serving cluster and the
//! switch ends. Weights always sum to 100.

use std::time::{Duration, SystemTime};

use serde::Serialize;

use super::{EnvoyWarmth, Phase};
use crate::policy::switchover::ShiftMode;

/// One RayService's switchover state, as `/debug/state` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ServiceSwitch {
    /// The cluster traffic belongs to.
    pub serving: String,
    /// Since when (it was first seen, or traffic moved to it).
    #[serde(skip)]
    pub(super) serving_since: SystemTime,
    /// Traffic moved to `serving` here (a switch this replica made): only then do its
    /// peers take it as a move done.
    #[serde(skip)]
    pub(super) moved: bool,
    /// The cluster that move came from (this replica's, or a peer's taken at start).
    pub(super) moved_from: Option<String>,
    /// This replica saw the current target named (it knew the RayService before): its
    /// own `target_since` is when the switch began, and a peer's start much earlier is
    /// no start any replica could have seen (a skewed clock, or a lie).
    #[serde(skip)]
    pub(super) saw_begin: bool,
    /// The cluster traffic is moving (or waiting to move) to.
    pub target: Option<String>,
    pub phase: Phase,
    pub reason: String,
    /// Percent of traffic per cluster (only clusters with some).
    pub weights: Vec<(String, u32)>,
    /// The operator's word on this switch (`switchover.control`), unless `auto`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub control: Option<String>,
    /// The share an operator's hold kept on the target: when the hold is lifted, a
    /// progressive schedule resumes from its first step at or above it.
    #[serde(skip)]
    pub(super) held_at: Option<u32>,
    /// When the current target became the target: its dashboard must have answered
    /// since, so a status read before an upgrade began is never taken for readiness.
    #[serde(skip)]
    pub(super) target_since: Option<SystemTime>,
    /// When the target was first found ready while some Envoy had not warmed it.
    #[serde(skip)]
    pub(super) warming_since: Option<SystemTime>,
    #[serde(skip)]
    pub(super) warm_timeout: Duration,
    #[serde(skip)]
    pub(super) step: usize,
    /// When traffic started to move to the target (the first step): each step is due
    /// an interval after the one before, from here. The earliest start any replica saw
    /// (`live::peers`) is taken, so replicas step together and a restarted one resumes.
    #[serde(skip)]
    pub(super) shift_started: Option<SystemTime>,
    /// When the next progressive step is due.
    #[serde(skip)]
    pub(super) step_due: Option<SystemTime>,
    /// The decision to send nothing to the pending cluster, whose requests failed (a
    /// RayService's switch only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rollback: Option<crate::pipeline::outcomes::Rollback>,
}

impl ServiceSwitch {
    /// No switch: all traffic stays where it is.
    pub(super) fn stay(&mut self) {
        if self.phase != Phase::Stable || self.reason.is_empty() {
            self.reason = format!("serving {}", self.serving);
        }
        self.phase = Phase::Stable;
        self.step = 0;
        self.shift_started = None;
        self.weights = vec![(self.serving.clone(), 100)];
    }

    /// Connected Envoys that have not warmed `routed` yet, each once, and the note for
    /// the reason when the wait passed `warm_timeout` (then none are waited for: each
    /// Envoy switches once it has warmed the target).
    pub(super) fn cold_envoys(
        &mut self,
        routed: &[String],
        envoys: &dyn EnvoyWarmth,
        warm_timeout: Duration,
        now: SystemTime,
    ) -> (Vec<String>, String) {
        let mut cold = Vec::new();
        for name in routed {
            for envoy in envoys.cold_envoys(name) {
                if !cold.contains(&envoy) {
                    cold.push(envoy);
                }
            }
        }
        if cold.is_empty() {
            self.warming_since = None;
            return (cold, String::new());
        }
        let since = *self.warming_since.get_or_insert(now);
        if now.duration_since(since).unwrap_or_default() < warm_timeout {
            return (cold, String::new());
        }
        let note = format!(
            " ({} Envoy(s) had not warmed it after {:?}: {}; each switches once it has)",
            cold.len(),
            warm_timeout,
            cold.join(", ")
        );
        (Vec::new(), note)
    }

    /// Held: an Envoy rejected the target.
    pub(super) fn hold_rejected(&mut self, target: &str, rejecting: &[String]) {
        self.phase = Phase::Rejected;
        self.reason = format!(
            "{target} was rejected by {} Envoy(s): {}; no traffic moves to it until its \
             configuration changes",
            rejecting.len(),
            rejecting.join(", ")
        );
        self.step = 0;
        self.shift_started = None;
        self.warming_since = None;
        self.weights = vec![(self.serving.clone(), 100)];
    }

    /// Held: the target is ready, and some Envoy has not warmed it.
    pub(super) fn hold_warming(&mut self, target: &str, cold: &[String]) {
        self.phase = Phase::Warming;
        self.reason = format!(
            "{target} is ready; waiting for {} Envoy(s) to ACK it and its endpoints: {}",
            cold.len(),
            cold.join(", ")
        );
        self.weights = vec![(self.serving.clone(), 100)];
    }

    /// Held: the target is not ready.
    pub(super) fn hold_not_ready(&mut self, target: &str, why: &str) {
        self.phase = Phase::Waiting;
        self.reason = format!("{target} is not ready: {why}");
        self.step = 0;
        self.shift_started = None;
        self.weights = vec![(self.serving.clone(), 100)];
    }

    /// Held by the operator (`switchover.control: hold`): the target keeps `weight`
    /// percent, what it had or less. The schedule's clock stops (no start to share, no
    /// step due) until the hold is lifted ([`ServiceSwitch::resume_after_hold`]). At 0 no
    /// traffic has moved, so the warmth gate comes again before the first step.
    pub(super) fn hold_by_operator(&mut self, target: String, weight: u32) {
        self.phase = Phase::Held;
        self.reason = format!(
            "{target} is ready; held by the operator (switchover.control: hold) at {weight}%"
        );
        self.held_at = Some(weight);
        self.shift_started = None;
        self.step_due = None;
        if weight == 0 {
            self.step = 0;
        }
        self.weights = self.split(target, weight);
    }

    /// A hold was lifted: a progressive schedule goes on from its first step at or above
    /// the held share, now (the time spent held does not count); from its start if
    /// nothing had moved.
    pub(super) fn resume_after_hold(&mut self, shift: &ShiftMode, now: SystemTime) {
        let Some(held) = self.held_at.take() else {
            return;
        };
        self.shift_started = None;
        if let (ShiftMode::Progressive { steps, interval }, true) = (shift, held > 0) {
            let next = steps
                .iter()
                .position(|s| *s >= held)
                .unwrap_or(steps.len().saturating_sub(1));
            self.shift_started = Some(now - *interval * next as u32);
        }
    }

    /// Aborted by the operator (`switchover.control: abort`): the pending cluster
    /// `target` gets nothing.
    pub(super) fn hold_aborted(&mut self, target: &str) {
        self.phase = Phase::Aborted;
        self.reason = format!(
            "the switch to {target} was aborted by the operator (switchover.control: abort): \
             all traffic stays on {}",
            self.serving
        );
        self.step = 0;
        self.shift_started = None;
        self.warming_since = None;
        self.weights = vec![(self.serving.clone(), 100)];
    }

    /// `weight` percent (below 100) on `target`, the rest on the serving cluster; at 0 the
    /// route names only the serving cluster.
    fn split(&self, target: String, weight: u32) -> Vec<(String, u32)> {
        if weight == 0 {
            vec![(self.serving.clone(), 100)]
        } else {
            vec![(self.serving.clone(), 100 - weight), (target, weight)]
        }
    }

    /// The percent of traffic `cluster` has now.
    pub(super) fn weight_of(&self, cluster: &str) -> u32 {
        self.weights
            .iter()
            .find(|(c, _)| c == cluster)
            .map_or(0, |(_, w)| *w)
    }

    /// `weight` percent of the traffic on `target`; at 100 the target serves and the
    /// switch is done.
    pub(super) fn shift(
        &mut self,
        target: String,
        weight: u32,
        desperate: bool,
        warm_note: &str,
        now: SystemTime,
    ) {
        if weight < 100 {
            self.phase = Phase::Shifting;
            self.reason = format!("{target} is ready: {weight}% of traffic{warm_note}");
            // (At 0, held by capacity: the route names only the serving cluster.)
            self.weights = self.split(target, weight);
            return;
        }
        self.reason = if desperate {
            format!(
                "{} has no healthy proxy left; moved to {target}",
                self.serving
            )
        } else {
            format!("moved to {target}: it is ready{warm_note}")
        };
        self.moved_from = Some(std::mem::replace(&mut self.serving, target));
        self.serving_since = now;
        self.moved = true;
        self.target = None;
        self.phase = Phase::Stable;
        self.step = 0;
        self.shift_started = None;
        self.step_due = None;
        self.weights = vec![(self.serving.clone(), 100)];
    }
}
