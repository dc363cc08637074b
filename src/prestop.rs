//! The pre-stop handshake: a Ray pod about to stop asks ray-xds, from its preStop hook,
//! `GET /prestop?address=<its IP>`, and is answered once every connected Envoy, of this
//! replica and of each peer, has moved past every endpoint resource that listed that
//! address (or once a grace passes). Ray's proxy does not drain at SIGTERM: what Envoy
//! still sends there fails, and what was in flight may have run. Kubelet sends SIGTERM
//! only after the hook returns, so the answer's timing is the pod's.
//!
//! ray-xds changes nothing for the call: the source's word that the pod is going away (a
//! terminating pod, a proxy marked `draining` in the services file) takes its endpoints
//! out, as it always did; the handshake only waits until every Envoy has taken that.
//!
//! Invariants: the answer is 200 only when the published endpoints list nothing at the
//! address and no connected Envoy holds a resource that listed it at a version other
//! than one seen without it (on every peer asked too); otherwise 504 at the grace,
//! naming who it still waits for. A call costs index lookups ([`index`], one task decodes
//! what changes), not decoding; at most [`AT_ONCE`] calls and as many peers' calls wait
//! at once, far under the admin port's connection cap, so probes always get in. An
//! address is an IP (every endpoint of the pod: its proxies and its ingress replicas) or
//! an IP and port (one endpoint); an IPv4-mapped IPv6 address is its IPv4 address.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use crate::xds::{Clients, ResourceType};

pub(crate) mod index;

pub(crate) use self::index::EndpointIndex;

/// The path of the handshake on the admin port.
pub(crate) const PATH: &str = "/prestop";

/// How long a call waits by default, and at most: under the admin port's idle timeout
/// (30 s), which may close a connection whose answer takes longer.
pub(crate) const DEFAULT_GRACE: Duration = Duration::from_secs(20);
pub(crate) const MAX_GRACE: Duration = Duration::from_secs(25);

/// Calls waiting at once, and as many peers' calls (each its own bound); more are
/// answered 503 at once. Together far under the admin port's 256 connections.
pub(crate) const AT_ONCE: usize = 64;

/// How often a waiting call looks again.
const LOOK_EVERY: Duration = Duration::from_millis(200);

/// What a call waits for the Envoys to drop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Target {
    /// Every endpoint at this IP: a pod's.
    Ip(IpAddr),
    /// One endpoint.
    Socket(SocketAddr),
}

impl Target {
    pub(crate) fn parse(text: &str) -> Result<Target, String> {
        if let Ok(ip) = text.parse::<IpAddr>() {
            return Ok(Target::Ip(ip.to_canonical()));
        }
        text.parse::<SocketAddr>()
            .map(|s| Target::Socket(SocketAddr::new(s.ip().to_canonical(), s.port())))
            .map_err(|_| format!("address {text:?} is neither an IP address nor an IP and port"))
    }

    pub(crate) fn ip(self) -> IpAddr {
        match self {
            Target::Ip(ip) => ip,
            Target::Socket(s) => s.ip(),
        }
    }

    /// Whether an endpoint at this target's IP and `port` is one of it.
    pub(crate) fn has_port(self, port: u16) -> bool {
        match self {
            Target::Ip(_) => true,
            Target::Socket(s) => s.port() == port,
        }
    }

    pub(crate) fn matches(self, endpoint: SocketAddr) -> bool {
        endpoint.ip() == self.ip() && self.has_port(endpoint.port())
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Ip(ip) => write!(f, "{ip}"),
            Target::Socket(s) => write!(f, "{s}"),
        }
    }
}

/// Where one look at this replica stands.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Look {
    /// Every Envoy has moved past what listed the address.
    Dropped,
    /// The published endpoints still list the address (the source has not said the pod
    /// is going away): in how many resources.
    StillListed(usize),
    /// Published without it; these Envoys still hold a version that listed it.
    Waiting(Vec<String>),
}

/// One replica's wait. Per endpoint resource that listed the address, the versions of it
/// seen without the address: an Envoy holding any other version of it may still send
/// there.
pub(crate) struct LocalWait {
    target: Target,
    clean: BTreeMap<Arc<str>, BTreeSet<Arc<str>>>,
    first: bool,
}

impl LocalWait {
    pub(crate) fn new(target: Target) -> LocalWait {
        LocalWait {
            target,
            clean: BTreeMap::new(),
            first: true,
        }
    }

    /// Looks at what `index` says is published and what `clients` hold.
    pub(crate) fn look(&mut self, index: &EndpointIndex, clients: &Clients) -> Look {
        let Some(listing) = index.listing(self.target) else {
            return Look::StillListed(0);
        };
        let first = std::mem::replace(&mut self.first, false);
        if first && listing.is_empty() {
            // Already out when the call came: the resources it left lately.
            for name in index.departed(self.target) {
                self.clean.entry(name).or_default();
            }
        }
        if !listing.is_empty() {
            for (name, _) in &listing {
                self.clean.entry(name.clone()).or_default();
            }
            return Look::StillListed(listing.len());
        }
        // Listed nowhere now: each tracked resource's version now is a clean one.
        for (name, clean) in self.clean.iter_mut() {
            if let Some(version) = index.version_of(name) {
                clean.insert(version);
            }
        }
        let holding = clients.holding_other_than(ResourceType::Endpoints, &self.clean);
        if holding.is_empty() {
            Look::Dropped
        } else {
            Look::Waiting(holding)
        }
    }
}

/// Waits on this replica until [`Look::Dropped`] or `deadline`; the last look.
pub(crate) async fn wait_local(
    target: Target,
    index: Arc<EndpointIndex>,
    clients: Arc<Clients>,
    deadline: tokio::time::Instant,
) -> Look {
    let mut wait = LocalWait::new(target);
    loop {
        let look = wait.look(&index, &clients);
        if look == Look::Dropped || tokio::time::Instant::now() >= deadline {
            return look;
        }
        tokio::time::sleep_until((tokio::time::Instant::now() + LOOK_EVERY).min(deadline)).await;
    }
}

/// Asks one peer's address until it answers 200 or 504 (its own verdict), or the
/// deadline passes: a refused connection or a busy peer (503) is asked again.
async fn ask_peer(
    client: &hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        http_body_util::Empty<bytes::Bytes>,
    >,
    address: SocketAddr,
    target: Target,
    asker: &str,
    deadline: tokio::time::Instant,
) -> (bool, String) {
    use http_body_util::{BodyExt, Limited};
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        // An IPv6 endpoint's brackets, percent-encoded: a query may not hold them as is.
        let target = target.to_string().replace('[', "%5B").replace(']', "%5D");
        let uri = format!(
            "http://{address}{PATH}?address={target}&asker={asker}&grace={}ms",
            left.as_millis()
        );
        let asked = async {
            let uri: hyper::Uri = uri.parse().map_err(|e| format!("{e}"))?;
            let response = client.get(uri).await.map_err(|e| format!("asking: {e}"))?;
            let status = response.status();
            let body = Limited::new(response.into_body(), 64 * 1024)
                .collect()
                .await
                .map_err(|e| format!("reading the answer: {e}"))?
                .to_bytes();
            Ok::<_, String>((status, String::from_utf8_lossy(&body).into_owned()))
        };
        // The peer answers by the same deadline; a little longer for the answer to travel.
        let error = match tokio::time::timeout(left + Duration::from_secs(2), asked).await {
            Ok(Ok((status, body)))
                if status == hyper::StatusCode::OK
                    || status == hyper::StatusCode::GATEWAY_TIMEOUT =>
            {
                return (
                    status == hyper::StatusCode::OK,
                    crate::xds::clip(body.trim(), 2000),
                )
            }
            Ok(Ok((status, body))) => format!(
                "answered HTTP {}: {}",
                status.as_u16(),
                crate::xds::clip(body.trim(), 500)
            ),
            Ok(Err(e)) => e,
            Err(_) => "no answer by the grace".into(),
        };
        if tokio::time::Instant::now() + PEER_RETRY >= deadline {
            return (false, error);
        }
        tokio::time::sleep(PEER_RETRY).await;
    }
}

/// How soon a peer that did not answer is asked again.
const PEER_RETRY: Duration = Duration::from_millis(200);

/// One peer's answer.
#[derive(Debug, Serialize)]
pub(crate) struct PeerAnswer {
    pub peer: String,
    pub dropped: bool,
    pub detail: String,
}

/// Asks every address of every peer to wait for its own Envoys (`asker` set: this
/// replica's id, so that the one address that is this replica answers at once), until
/// `deadline`; what each said.
pub(crate) async fn ask_peers(
    peers: &[String],
    target: Target,
    asker: &str,
    deadline: tokio::time::Instant,
) -> Vec<PeerAnswer> {
    let client: hyper_util::client::legacy::Client<_, http_body_util::Empty<bytes::Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http();
    let mut asks = Vec::new();
    for peer in peers {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let addresses = match tokio::time::timeout(left, tokio::net::lookup_host(peer)).await {
            Ok(Ok(addresses)) => addresses
                .take(crate::live::peers::MAX_ADDRESSES_PER_PEER)
                .collect::<Vec<_>>(),
            Ok(Err(e)) => {
                asks.push(futures::future::Either::Left(std::future::ready(
                    PeerAnswer {
                        peer: peer.clone(),
                        dropped: false,
                        detail: format!("resolving it: {e}"),
                    },
                )));
                continue;
            }
            Err(_) => {
                asks.push(futures::future::Either::Left(std::future::ready(
                    PeerAnswer {
                        peer: peer.clone(),
                        dropped: false,
                        detail: "resolving it took past the grace".into(),
                    },
                )));
                continue;
            }
        };
        for address in addresses {
            let client = client.clone();
            let who = format!("{peer} ({address})");
            asks.push(futures::future::Either::Right(async move {
                let (dropped, detail) = ask_peer(&client, address, target, asker, deadline).await;
                PeerAnswer {
                    peer: who,
                    dropped,
                    detail,
                }
            }));
        }
    }
    futures::future::join_all(asks).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::xds::Snapshot;
    use envoy_types::pb::envoy::config::core::v3::{
        address, socket_address, Address, SocketAddress,
    };
    use envoy_types::pb::envoy::config::endpoint::v3::{
        lb_endpoint, ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints,
    };

    fn assignment(name: &str, endpoints: &[&str]) -> ClusterLoadAssignment {
        ClusterLoadAssignment {
            cluster_name: name.into(),
            endpoints: vec![LocalityLbEndpoints {
                lb_endpoints: endpoints
                    .iter()
                    .map(|e| {
                        let e: SocketAddr = e.parse().unwrap();
                        LbEndpoint {
                            host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(
                                Endpoint {
                                    address: Some(Address {
                                        address: Some(address::Address::SocketAddress(
                                            SocketAddress {
                                                address: e.ip().to_string(),
                                                port_specifier: Some(
                                                    socket_address::PortSpecifier::PortValue(
                                                        e.port().into(),
                                                    ),
                                                ),
                                                ..Default::default()
                                            },
                                        )),
                                    }),
                                    ..Default::default()
                                },
                            )),
                            ..Default::default()
                        }
                    })
                    .collect(),
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    fn snapshot(endpoints: Vec<ClusterLoadAssignment>) -> Snapshot {
        Snapshot::from_resources(&crate::xds::Resources {
            endpoints,
            ..Default::default()
        })
    }

    fn at(index: &EndpointIndex, target: &str) -> Vec<String> {
        let mut names: Vec<String> = index
            .listing(Target::parse(target).unwrap())
            .unwrap()
            .iter()
            .map(|(n, _)| n.to_string())
            .collect();
        names.sort();
        names
    }

    /// The index lists a pod's IP (its proxies and replicas, any port) or one endpoint,
    /// decodes only what changed, and remembers what an endpoint left; a wait sees the
    /// pod listed, then dropped once nothing lists it (no Envoy connected: nobody holds
    /// anything), and a call that comes after the removal still knows what it left.
    #[test]
    fn the_index_and_a_wait_follow_the_resources_that_list_the_address() {
        let index = EndpointIndex::default();
        let t0 = std::time::Instant::now();
        assert_eq!(index.listing(Target::parse("198.18.0.2").unwrap()), None);
        index.update(
            &snapshot(vec![
                assignment("ns/s/a", &["198.18.0.1:8000", "198.18.0.2:8000"]),
                assignment("ns/s/a/app/http", &["198.18.0.2:30001"]),
                assignment("ns/s/b", &["198.18.0.3:8000", "[::ffff:198.18.0.4]:8000"]),
            ]),
            t0,
        );
        assert_eq!(at(&index, "198.18.0.2"), ["ns/s/a", "ns/s/a/app/http"]);
        assert_eq!(at(&index, "198.18.0.2:30001"), ["ns/s/a/app/http"]);
        assert_eq!(at(&index, "198.18.0.2:9000"), Vec::<String>::new());
        assert_eq!(at(&index, "198.18.0.9"), Vec::<String>::new());
        // An IPv4-mapped address, published or asked, is its IPv4 address.
        assert_eq!(at(&index, "198.18.0.4"), ["ns/s/b"]);
        assert_eq!(at(&index, "::ffff:198.18.0.4"), ["ns/s/b"]);

        let clients = Clients::default();
        let pod = Target::parse("198.18.0.2").unwrap();
        let mut wait = LocalWait::new(pod);
        assert_eq!(wait.look(&index, &clients), Look::StillListed(2));
        index.update(
            &snapshot(vec![
                assignment("ns/s/a", &["198.18.0.1:8000"]),
                assignment("ns/s/b", &["198.18.0.3:8000", "[::ffff:198.18.0.4]:8000"]),
            ]),
            t0,
        );
        assert_eq!(wait.look(&index, &clients), Look::Dropped);
        // A call after the removal: what the pod left, remembered for a while.
        let departed: Vec<String> = index.departed(pod).iter().map(|n| n.to_string()).collect();
        assert_eq!(departed, ["ns/s/a", "ns/s/a/app/http"]);
        let mut late = LocalWait::new(pod);
        assert_eq!(late.look(&index, &clients), Look::Dropped);
        assert_eq!(late.clean.len(), 2, "{:?}", late.clean);
        // ...and forgotten after REMEMBER.
        index.update(
            &snapshot(vec![assignment("ns/s/a", &["198.18.0.1:8000"])]),
            t0 + index::REMEMBER + Duration::from_secs(1),
        );
        assert!(index.departed(pod).is_empty(), "forgotten after REMEMBER");
    }

    #[test]
    fn an_address_is_an_ip_or_an_ip_and_port() {
        assert_eq!(
            Target::parse("198.18.0.7").unwrap(),
            Target::Ip("198.18.0.7".parse().unwrap())
        );
        assert_eq!(
            Target::parse("198.18.0.7:8000").unwrap(),
            Target::Socket("198.18.0.7:8000".parse().unwrap())
        );
        assert_eq!(
            Target::parse("[fd00::1]:8000").unwrap(),
            Target::Socket("[fd00::1]:8000".parse().unwrap())
        );
        assert!(Target::parse("ray-worker-1").is_err());
        assert!(Target::parse("").is_err());
        assert_eq!(
            Target::parse("::ffff:198.18.0.7").unwrap(),
            Target::Ip("198.18.0.7".parse().unwrap())
        );
        let ip = Target::parse("198.18.0.7").unwrap();
        assert!(ip.matches("198.18.0.7:8000".parse().unwrap()));
        assert!(ip.matches("198.18.0.7:30001".parse().unwrap()));
        assert!(!ip.matches("198.18.0.8:8000".parse().unwrap()));
        let one = Target::parse("198.18.0.7:8000").unwrap();
        assert!(one.matches("198.18.0.7:8000".parse().unwrap()));
        assert!(!one.matches("198.18.0.7:9000".parse().unwrap()));
    }
}
