//! The probe state of one Ray Serve proxy: a sans-IO state machine fed with probe
//! outcomes, deciding when the proxy turns healthy, unhealthy or draining.
//!
//! Rules (pingora-style hysteresis, with the fast paths Ray's behaviour allows):
//! - the first outcome of a new proxy decides at once (there is no history to smooth);
//! - a refused connection is unhealthy at once: nothing listens there;
//! - a 503 saying the node is being drained is draining at once;
//! - otherwise `unhealthy_threshold` consecutive failures make it unhealthy, and
//!   `healthy_threshold` consecutive successes make an unhealthy or draining proxy healthy.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::SystemTime;

use serde::Serialize;

use crate::policy::probe::ProbePolicy;

/// What one `GET /-/healthz` found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// 200 `success`.
    Healthy,
    /// 503 `This node is being drained.`
    Draining,
    /// Connection refused.
    Refused,
    /// Anything else: a timeout, a reset, another status or body.
    Failed(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ProbeState {
    /// Not probed yet.
    Unknown,
    Healthy,
    Unhealthy,
    Draining,
}

impl ProbeState {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            ProbeState::Unknown => "unknown",
            ProbeState::Healthy => "healthy",
            ProbeState::Unhealthy => "unhealthy",
            ProbeState::Draining => "draining",
        }
    }
}

/// A state change, to log once and count.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Transition {
    pub from: ProbeState,
    pub to: ProbeState,
    pub reason: String,
}

/// The probe state of one proxy, as the prober publishes it: it changes only when the
/// proxy's health or routes do (the run of like outcomes that decides when is the
/// prober's own [`Streak`]), so consecutive publications share all but what changed.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ProxyProbe {
    pub state: ProbeState,
    /// When `state` was entered.
    #[serde(serialize_with = "unix_seconds")]
    pub since: SystemTime,
    /// Why: the outcome that caused the last transition (shared: the verdicts that quote
    /// it, and the tree nodes of the prober's states that a change copies, hold the one
    /// string).
    pub reason: Arc<str>,
    /// Route prefixes the proxy serves (`GET /-/routes`), once read; shared with the
    /// other proxies of its cluster that list the same (`live::route_tables`). Shown in
    /// `/debug/state` up to [`ROUTES_SHOWN`], then how many more.
    #[serde(serialize_with = "some_routes")]
    pub routes: Option<Arc<BTreeSet<String>>>,
}

/// The most route prefixes `/debug/state` shows per proxy.
pub(crate) const ROUTES_SHOWN: usize = 16;

fn some_routes<S: serde::Serializer>(
    routes: &Option<Arc<BTreeSet<String>>>,
    s: S,
) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeSeq;
    let Some(routes) = routes else {
        return s.serialize_none();
    };
    let more = routes.len().saturating_sub(ROUTES_SHOWN);
    let mut seq = s.serialize_seq(Some(routes.len().min(ROUTES_SHOWN) + usize::from(more > 0)))?;
    for r in routes.iter().take(ROUTES_SHOWN) {
        seq.serialize_element(r)?;
    }
    if more > 0 {
        seq.serialize_element(&format!("... and {more} more"))?;
    }
    seq.end()
}

fn unix_seconds<S: serde::Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(
        t.duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0),
    )
}

impl ProxyProbe {
    pub fn new(now: SystemTime) -> ProxyProbe {
        ProxyProbe {
            state: ProbeState::Unknown,
            since: now,
            reason: "not probed yet".into(),
            routes: None,
        }
    }

    /// Feeds one outcome, counted in `streak`; returns the transition it caused, if any
    /// (the prober does the same in two steps, writing the state only when it changes).
    #[cfg(test)]
    pub(crate) fn observe(
        &mut self,
        streak: &mut Streak,
        outcome: &Outcome,
        settings: &ProbePolicy,
        now: SystemTime,
    ) -> Option<Transition> {
        let next = streak.observe(self.state, outcome, settings)?;
        Some(self.enter(next, now))
    }

    /// Enters `to` for `reason` (a state other than the present one, as
    /// [`Streak::observe`] gives).
    pub(crate) fn enter(
        &mut self,
        (to, reason): (ProbeState, String),
        now: SystemTime,
    ) -> Transition {
        let from = std::mem::replace(&mut self.state, to);
        self.since = now;
        self.reason = reason.as_str().into();
        Transition { from, to, reason }
    }
}

/// A proxy's run of like outcomes: the prober's own, never published (it changes with
/// every probe; what is published changes only with health).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Streak {
    pub successes: u32,
    pub failures: u32,
}

impl Streak {
    /// Feeds one outcome of a proxy in `state`: the state it enters and why, when other
    /// than `state`.
    pub(crate) fn observe(
        &mut self,
        state: ProbeState,
        outcome: &Outcome,
        settings: &ProbePolicy,
    ) -> Option<(ProbeState, String)> {
        let (next, reason) = match outcome {
            Outcome::Healthy => {
                self.successes = self.successes.saturating_add(1);
                self.failures = 0;
                let enough =
                    state == ProbeState::Unknown || self.successes >= settings.healthy_threshold;
                (
                    enough.then_some(ProbeState::Healthy),
                    "answered success (HTTP 200 or gRPC OK)".to_string(),
                )
            }
            Outcome::Draining => {
                self.successes = 0;
                self.failures = 0;
                (
                    Some(ProbeState::Draining),
                    "answered: this node is being drained (HTTP 503 or gRPC UNAVAILABLE)".into(),
                )
            }
            Outcome::Refused => {
                self.successes = 0;
                self.failures = self.failures.saturating_add(1);
                (Some(ProbeState::Unhealthy), "connection refused".into())
            }
            Outcome::Failed(why) => {
                self.successes = 0;
                self.failures = self.failures.saturating_add(1);
                let enough =
                    state == ProbeState::Unknown || self.failures >= settings.unhealthy_threshold;
                (enough.then_some(ProbeState::Unhealthy), why.clone())
            }
        };
        next.filter(|to| *to != state).map(|to| (to, reason))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A proxy's probe and its streak, fed together.
    struct Fed(ProxyProbe, Streak);

    impl Fed {
        fn observe(&mut self, o: &Outcome, s: &ProbePolicy, t: SystemTime) -> Option<Transition> {
            self.0.observe(&mut self.1, o, s, t)
        }
    }

    fn probe() -> (Fed, ProbePolicy, SystemTime) {
        (
            Fed(ProxyProbe::new(SystemTime::UNIX_EPOCH), Streak::default()),
            ProbePolicy::default(),
            SystemTime::UNIX_EPOCH,
        )
    }

    fn failed() -> Outcome {
        Outcome::Failed("timeout".into())
    }

    #[test]
    fn the_first_outcome_decides() {
        let (mut p, s, t) = probe();
        assert_eq!(
            p.observe(&Outcome::Healthy, &s, t).unwrap().to,
            ProbeState::Healthy
        );
        let (mut p, s, t) = probe();
        assert_eq!(
            p.observe(&failed(), &s, t).unwrap().to,
            ProbeState::Unhealthy
        );
    }

    #[test]
    fn thresholds_hold_against_flapping() {
        let (mut p, s, t) = probe();
        p.observe(&Outcome::Healthy, &s, t);
        // Alternating results never reach two failures in a row.
        for _ in 0..10 {
            assert!(p.observe(&failed(), &s, t).is_none());
            assert!(p.observe(&Outcome::Healthy, &s, t).is_none());
        }
        assert_eq!(p.0.state, ProbeState::Healthy);
        assert!(p.observe(&failed(), &s, t).is_none());
        let tr = p.observe(&failed(), &s, t).unwrap();
        assert_eq!(
            (tr.from, tr.to),
            (ProbeState::Healthy, ProbeState::Unhealthy)
        );
        // One success is not enough to come back.
        assert!(p.observe(&Outcome::Healthy, &s, t).is_none());
        assert!(p.observe(&failed(), &s, t).is_none());
        assert!(p.observe(&Outcome::Healthy, &s, t).is_none());
        assert_eq!(
            p.observe(&Outcome::Healthy, &s, t).unwrap().to,
            ProbeState::Healthy
        );
    }

    #[test]
    fn refused_and_draining_act_at_once() {
        let (mut p, s, t) = probe();
        p.observe(&Outcome::Healthy, &s, t);
        assert_eq!(
            p.observe(&Outcome::Refused, &s, t).unwrap().reason,
            "connection refused"
        );
        let (mut p, s, t) = probe();
        p.observe(&Outcome::Healthy, &s, t);
        assert_eq!(
            p.observe(&Outcome::Draining, &s, t).unwrap().to,
            ProbeState::Draining
        );
        assert!(
            p.observe(&Outcome::Draining, &s, t).is_none(),
            "logged once"
        );
        assert!(p.observe(&Outcome::Healthy, &s, t).is_none());
        assert_eq!(
            p.observe(&Outcome::Healthy, &s, t).unwrap().to,
            ProbeState::Healthy
        );
    }
}
