//! Which published endpoint resources list which address, kept by one task that follows
//! the published snapshots, so that the pre-stop calls waiting at once look it up
//! instead of each decoding every resource. A resource is decoded only when its version
//! changes. An address that leaves a resource is remembered with that resource for
//! [`REMEMBER`] (at most [`MAX_DEPARTURES`] of them), so a call that arrives after its
//! pod was already taken out still knows which resources its Envoys must have moved past.
//!
//! Invariants: after [`EndpointIndex::update`] with a snapshot, [`EndpointIndex::listing`]
//! is exactly what that snapshot's endpoint resources list; memory is bounded by the
//! snapshot's endpoints plus the departures kept.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::{address, socket_address};
use envoy_types::pb::envoy::config::endpoint::v3::{lb_endpoint, ClusterLoadAssignment};
use prost::Message;

use super::Target;
use crate::xds::{ResourceType, Snapshot};

/// How long an address that left a resource is remembered with it.
pub(crate) const REMEMBER: Duration = Duration::from_secs(120);

/// Departures remembered at most (the oldest go first).
pub(crate) const MAX_DEPARTURES: usize = 100_000;

/// The index, shared by the task that updates it and the calls that read it.
#[derive(Default)]
pub(crate) struct EndpointIndex(Mutex<State>);

#[derive(Default)]
struct State {
    /// The version of the snapshot indexed.
    snapshot: Option<String>,
    /// Endpoint resource → (its version, the endpoints it lists).
    resources: HashMap<Arc<str>, (Arc<str>, Vec<SocketAddr>)>,
    /// Address → endpoint resource → the ports of its endpoints there.
    by_ip: HashMap<IpAddr, HashMap<Arc<str>, Vec<u16>>>,
    /// Endpoints that left a resource, oldest first: (when, endpoint, resource).
    departures: VecDeque<(Instant, SocketAddr, Arc<str>)>,
}

impl EndpointIndex {
    /// Brings the index to `snapshot`: decodes the endpoint resources whose version
    /// changed, and notes the endpoints that left one.
    pub(crate) fn update(&self, snapshot: &Snapshot, now: Instant) {
        let mut state = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if state.snapshot.as_deref() == Some(snapshot.version()) {
            return;
        }
        let published = snapshot.resources(ResourceType::Endpoints);
        let gone: Vec<Arc<str>> = state
            .resources
            .keys()
            .filter(|name| !published.contains_key(*name))
            .cloned()
            .collect();
        for name in gone {
            state.set(&name, None, now);
        }
        for (name, resource) in published {
            let unchanged = state
                .resources
                .get(name)
                .is_some_and(|(version, _)| *version == resource.version);
            if unchanged {
                continue;
            }
            let endpoints = ClusterLoadAssignment::decode(resource.body.value.as_slice())
                .map(|a| endpoints_of(&a))
                .unwrap_or_default();
            state.set(name, Some((resource.version.clone(), endpoints)), now);
        }
        while state
            .departures
            .front()
            .is_some_and(|(at, _, _)| now.saturating_duration_since(*at) > REMEMBER)
            || state.departures.len() > MAX_DEPARTURES
        {
            state.departures.pop_front();
        }
        state.snapshot = Some(snapshot.version().to_string());
    }

    /// The resources of the indexed snapshot that list an endpoint at `target`, with
    /// their versions; `None` before the first snapshot.
    pub(crate) fn listing(&self, target: Target) -> Option<Vec<(Arc<str>, Arc<str>)>> {
        let state = self.0.lock().unwrap_or_else(|e| e.into_inner());
        state.snapshot.as_ref()?;
        let Some(names) = state.by_ip.get(&target.ip()) else {
            return Some(Vec::new());
        };
        Some(
            names
                .iter()
                .filter(|(_, ports)| ports.iter().any(|port| target.has_port(*port)))
                .filter_map(|(name, _)| {
                    let (version, _) = state.resources.get(name)?;
                    Some((name.clone(), version.clone()))
                })
                .collect(),
        )
    }

    /// The version of `name` in the indexed snapshot.
    pub(crate) fn version_of(&self, name: &str) -> Option<Arc<str>> {
        let state = self.0.lock().unwrap_or_else(|e| e.into_inner());
        state
            .resources
            .get(name)
            .map(|(version, _)| version.clone())
    }

    /// Follows `snapshots` until `shutdown`, indexing each one published.
    pub(crate) async fn follow(
        self: Arc<Self>,
        mut snapshots: tokio::sync::watch::Receiver<Option<Arc<Snapshot>>>,
        shutdown: tokio_util::sync::CancellationToken,
    ) {
        loop {
            let snapshot = snapshots.borrow_and_update().clone();
            if let Some(snapshot) = snapshot {
                self.update(&snapshot, Instant::now());
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                changed = snapshots.changed() => if changed.is_err() { return },
            }
        }
    }

    /// The resources an endpoint at `target` left within [`REMEMBER`].
    pub(crate) fn departed(&self, target: Target) -> Vec<Arc<str>> {
        let state = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let mut names: Vec<Arc<str>> = state
            .departures
            .iter()
            .filter(|(_, endpoint, _)| target.matches(*endpoint))
            .map(|(_, _, name)| name.clone())
            .collect();
        names.sort();
        names.dedup();
        names
    }
}

impl State {
    /// Replaces what `name` lists (`None`: it is gone), noting what left it.
    fn set(&mut self, name: &Arc<str>, new: Option<(Arc<str>, Vec<SocketAddr>)>, now: Instant) {
        let old = self
            .resources
            .remove(name)
            .map(|(_, e)| e)
            .unwrap_or_default();
        let kept: &[SocketAddr] = new.as_ref().map_or(&[], |(_, e)| e);
        for endpoint in &old {
            if let Some(names) = self.by_ip.get_mut(&endpoint.ip()) {
                names.remove(name);
                if names.is_empty() {
                    self.by_ip.remove(&endpoint.ip());
                }
            }
            if !kept.contains(endpoint) {
                self.departures.push_back((now, *endpoint, name.clone()));
            }
        }
        if let Some((version, endpoints)) = new {
            for endpoint in &endpoints {
                self.by_ip
                    .entry(endpoint.ip())
                    .or_default()
                    .entry(name.clone())
                    .or_default()
                    .push(endpoint.port());
            }
            self.resources.insert(name.clone(), (version, endpoints));
        }
    }
}

/// The endpoints an assignment lists (IP addresses canonical: an IPv4-mapped IPv6
/// address as IPv4).
fn endpoints_of(assignment: &ClusterLoadAssignment) -> Vec<SocketAddr> {
    let mut out: Vec<SocketAddr> = assignment
        .endpoints
        .iter()
        .flat_map(|locality| &locality.lb_endpoints)
        .filter_map(|e| match &e.host_identifier {
            Some(lb_endpoint::HostIdentifier::Endpoint(e)) => e.address.as_ref(),
            _ => None,
        })
        .filter_map(|a| match &a.address {
            Some(address::Address::SocketAddress(s)) => {
                let port = match s.port_specifier {
                    Some(socket_address::PortSpecifier::PortValue(p)) => u16::try_from(p).ok()?,
                    _ => return None,
                };
                let ip = s.address.parse::<IpAddr>().ok()?.to_canonical();
                Some(SocketAddr::new(ip, port))
            }
            _ => None,
        })
        .collect();
    out.sort();
    out.dedup();
    out
}
