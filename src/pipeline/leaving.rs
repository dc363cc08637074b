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
use std::time::{Duration, SystemTime};

use crate::model::{Model, Protocol};

/// How long a replica that left stays published while its route moves: far below Ray's
/// draining period, far above an RDS round trip.
pub const HOLD: Duration = Duration::from_secs(5);

/// (application Envoy cluster, replica) → until when it is held.
#[derive(Clone, Debug, Default)]
pub struct Leaving {
    held: BTreeMap<(String, SocketAddr), SystemTime>,
}

impl Leaving {
    /// Notes the replicas `previous` had and `current` lacks (their application still
    /// listed), forgets expired ones and any that came back, and returns `current` with
    /// those still held added back to their application.
    pub fn update(&mut self, previous: &Model, current: &Model, now: SystemTime) -> Model {
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
        if self.held.is_empty() {
            return current.clone();
        }
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
                            list.push(*address);
                        }
                    }
                }
            }
        }
        // Only what keeps the model valid (an address may have become another endpoint).
        Model::new(services.clone()).unwrap_or_else(|_| current.clone())
    }

    /// The held replicas of each application Envoy cluster.
    pub fn held(&self) -> BTreeMap<String, Vec<SocketAddr>> {
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
