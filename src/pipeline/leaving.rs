//! Ingress replicas that left their application's target group, kept in its Envoy cluster
//! for a moment when the application's traffic moves to the proxies. Pure: time is passed
//! in.
//!
//! Why: when the last routable replica of an application leaves (a redeploy, a scale to
//! the fallback), one build both empties the application's cluster and moves its route to
//! the proxies. Envoy gets endpoints before routes, so for the round trip between the two
//! its route would name an empty cluster and answer "no healthy upstream" (nothing
//! retries a local reply). Ray keeps a stopping replica serving for its draining period
//! (`RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S`, 30 s; about 25 s seen), so the
//! replicas that just left stay published for [`HOLD`], no longer routable: the route
//! moves first, the endpoints go after.
//!
//! Held only while their application has no routable replica (the route moved): a
//! replica that leaves while others serve goes at once, as a departed proxy does, and
//! Envoy finishes what it holds there. One whose probe fails is never published
//! (`live::health`): a dead replica serves nothing.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::model::{Model, Protocol};

/// How long a replica that left stays published while its route moves: far below Ray's
/// draining period, far above an RDS round trip.
pub(crate) const HOLD: Duration = Duration::from_secs(5);

/// (application Envoy cluster, replica) → until when it is held.
#[derive(Clone, Debug, Default)]
pub(crate) struct Leaving {
    held: BTreeMap<(String, SocketAddr), SystemTime>,
}

impl Leaving {
    /// As [`Leaving::update`], sharing `current` when nothing is held, and doing nothing
    /// when `current` is the very model of the last build and nothing was held (nothing
    /// can have left).
    pub(crate) fn update_shared(
        &mut self,
        previous: &Arc<Model>,
        current: &Arc<Model>,
        now: SystemTime,
    ) -> Arc<Model> {
        if Arc::ptr_eq(previous, current) && self.held.is_empty() {
            return current.clone();
        }
        self.note(previous, current, now);
        if self.held.is_empty() {
            current.clone()
        } else {
            Arc::new(self.with_held(current))
        }
    }

    /// Notes the replicas `previous` had and `current` lacks (their application still
    /// listed), forgets expired ones and any that came back, and returns `current` with
    /// those still held added back to their application (the unit tests' form of
    /// [`Leaving::update_shared`]).
    #[cfg(test)]
    pub fn update(&mut self, previous: &Model, current: &Model, now: SystemTime) -> Model {
        self.note(previous, current, now);
        if self.held.is_empty() {
            return current.clone();
        }
        self.with_held(current)
    }

    /// Notes the replicas `previous` had and `current` lacks, and forgets expired ones
    /// and any that came back.
    fn note(&mut self, previous: &Model, current: &Model, now: SystemTime) {
        let replicas = |m: &Model| -> BTreeMap<(String, SocketAddr), Protocol> {
            let mut out = BTreeMap::new();
            for s in m.services() {
                for c in s.clusters.iter().filter(|c| c.direct_ingress) {
                    for a in &c.applications {
                        for protocol in [Protocol::Http, Protocol::Grpc] {
                            let name = s.envoy_app_cluster_name(&c.name, &a.name, protocol);
                            for r in a.replicas(protocol) {
                                out.insert((name.clone(), *r), protocol);
                            }
                        }
                    }
                }
            }
            out
        };
        let (before, after) = (replicas(previous), replicas(current));
        for key in before.keys().filter(|k| !after.contains_key(*k)) {
            self.held.entry(key.clone()).or_insert(now + HOLD);
        }
        self.held
            .retain(|key, until| *until > now && !after.contains_key(key));
    }

    /// `current` with the replicas held added back to their application.
    fn with_held(&self, current: &Model) -> Model {
        // A held address that is an endpoint again (another application's replica, a
        // proxy) stays that alone: only what keeps the model valid is added back, each
        // address once, so one conflict never drops the others.
        let mut in_use: std::collections::BTreeSet<SocketAddr> =
            current.endpoints().map(|(a, _)| a).collect();
        let mut services = current.services().to_vec();
        for s in &mut services {
            let service = s.clone();
            for c in s.clusters.iter_mut().filter(|c| c.direct_ingress) {
                for a in &mut c.applications {
                    for protocol in [Protocol::Http, Protocol::Grpc] {
                        let name = service.envoy_app_cluster_name(&c.name, &a.name, protocol);
                        let list = match protocol {
                            Protocol::Http => &mut a.http_replicas,
                            Protocol::Grpc => &mut a.grpc_replicas,
                        };
                        for ((cluster, address), _) in self
                            .held
                            .range((name.clone(), SocketAddr::from(([0; 4], 0)))..)
                        {
                            if *cluster != name {
                                break;
                            }
                            if in_use.insert(*address) {
                                list.push(*address);
                            }
                        }
                    }
                }
            }
        }
        // (Valid by construction; should it not be, the current model as it is.)
        Model::new(services).unwrap_or_else(|_| current.clone())
    }

    /// The held replicas of each application Envoy cluster.
    pub(crate) fn held(&self) -> BTreeMap<String, Vec<SocketAddr>> {
        let mut out: BTreeMap<String, Vec<SocketAddr>> = BTreeMap::new();
        for (cluster, address) in self.held.keys() {
            out.entry(cluster.clone()).or_default().push(*address);
        }
        out
    }

    /// When the next held replica goes.
    pub fn next_expiry(&self) -> Option<SystemTime> {
        self.held.values().min().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::test_support::{app, service};

    /// Two RayServices with direct ingress: `aaa` with `work` and `echo`, `bbb` with `y`,
    /// each application with the replica ports given.
    fn model(work: &[u16], echo: &[u16], y: &[u16]) -> Model {
        let mut a = service("aaa", "a1", &[8000]);
        a.clusters[0].direct_ingress = true;
        a.clusters[0].applications = vec![
            app("echo", Some("/"), echo),
            app("work", Some("/work"), work),
        ];
        let mut b = service("bbb", "b1", &[9000]);
        b.clusters[0].direct_ingress = true;
        b.clusters[0].applications = vec![app("y", Some("/y"), y)];
        Model::new(vec![a, b]).unwrap()
    }

    fn replicas(m: &Model, service: usize, app: &str) -> Vec<u16> {
        let c = &m.services()[service].clusters[0];
        let a = c.application(app).unwrap();
        a.http_replicas.iter().map(|r| r.port()).collect()
    }

    const T0: SystemTime = SystemTime::UNIX_EPOCH;

    #[test]
    fn a_replica_that_left_stays_for_the_hold_then_goes() {
        let mut leaving = Leaving::default();
        let before = model(&[30000], &[30001], &[30009]);
        let after = model(&[], &[30001], &[30009]);
        let out = leaving.update(&before, &after, T0);
        assert_eq!(replicas(&out, 0, "work"), [30000]);
        assert_eq!(leaving.next_expiry(), Some(T0 + HOLD));
        let out = leaving.update(&after, &after, T0 + HOLD);
        assert!(replicas(&out, 0, "work").is_empty());
        assert!(leaving.held().is_empty());
    }

    /// A held replica's port taken by another application within the hold: that one is
    /// not added back (it is the other's now), and every other held replica still is.
    #[test]
    fn a_held_address_in_use_again_is_left_out_alone() {
        let mut leaving = Leaving::default();
        let before = model(&[30000], &[30001], &[30009]);
        // `work`'s last replica left and its port is `echo`'s now; `bbb`'s `y` lost its.
        let after = model(&[], &[30000, 30001], &[]);
        let out = leaving.update(&before, &after, T0);
        assert!(replicas(&out, 0, "work").is_empty());
        assert_eq!(replicas(&out, 0, "echo"), [30000, 30001]);
        assert_eq!(
            replicas(&out, 1, "y"),
            [30009],
            "bbb keeps its held replica"
        );
    }
}
