//! The pre-stop handshake: a Ray pod about to stop asks ray-xds, from its preStop hook,
//! `GET /prestop?address=<its IP>`, and is answered once every connected Envoy, of this
//! replica and of each peer, holds endpoints without that address (or once a grace
//! passes). Ray's proxy does not drain at SIGTERM: what Envoy still sends there fails,
//! and what was in flight may have run. Kubelet sends SIGTERM only after the hook
//! returns, so the answer's timing is the pod's.
//!
//! ray-xds changes nothing for the call: the source's word that the pod is going away (a
//! terminating pod, a proxy marked `draining` in the services file) takes its endpoints
//! out, as it always did; the handshake only waits until every Envoy has ACKed that.
//!
//! Invariants: the answer is 200 only when the snapshot published now has no endpoint at
//! the address, and every connected Envoy subscribing to an endpoint resource that held
//! one during the wait holds that resource at its version now (on every peer that was
//! asked too); otherwise 504 at the grace, naming who it still waits for. An address is
//! an IP (every endpoint of the pod: its proxies and its ingress replicas) or an IP and
//! port (one endpoint).

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::endpoint::v3::{lb_endpoint, ClusterLoadAssignment};
use prost::Message;
use serde::Serialize;

use crate::xds::{Clients, ResourceType, Snapshot};

/// The path of the handshake on the admin port.
pub(crate) const PATH: &str = "/prestop";

/// How long a call waits by default, and at most: under the admin port's idle timeout
/// (30 s), which may close a connection whose answer takes longer.
pub(crate) const DEFAULT_GRACE: Duration = Duration::from_secs(20);
pub(crate) const MAX_GRACE: Duration = Duration::from_secs(25);

/// Calls waiting at once; more are answered 503 at once.
pub(crate) const AT_ONCE: usize = 256;

/// How often a waiting call looks again.
const LOOK_EVERY: Duration = Duration::from_millis(100);

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
            return Ok(Target::Ip(ip));
        }
        text.parse::<SocketAddr>()
            .map(Target::Socket)
            .map_err(|_| format!("address {text:?} is neither an IP address nor an IP and port"))
    }

    fn matches(self, ip: IpAddr, port: u32) -> bool {
        match self {
            Target::Ip(target) => target == ip,
            Target::Socket(target) => target.ip() == ip && u32::from(target.port()) == port,
        }
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

/// The endpoint resources of `snapshot` that list an endpoint at `target`.
pub(crate) fn resources_with(snapshot: &Snapshot, target: Target) -> BTreeSet<Arc<str>> {
    snapshot
        .resources(ResourceType::Endpoints)
        .values()
        .filter(|resource| {
            ClusterLoadAssignment::decode(resource.body.value.as_slice())
                .map(|assignment| lists(&assignment, target))
                .unwrap_or(false)
        })
        .map(|resource| resource.name.clone())
        .collect()
}

fn lists(assignment: &ClusterLoadAssignment, target: Target) -> bool {
    assignment
        .endpoints
        .iter()
        .flat_map(|locality| &locality.lb_endpoints)
        .filter_map(|e| match &e.host_identifier {
            Some(lb_endpoint::HostIdentifier::Endpoint(e)) => e.address.as_ref(),
            _ => None,
        })
        .filter_map(|a| match &a.address {
            Some(envoy_types::pb::envoy::config::core::v3::address::Address::SocketAddress(s)) => {
                Some(s)
            }
            _ => None,
        })
        .any(|s| {
            let port = match s.port_specifier {
                Some(
                    envoy_types::pb::envoy::config::core::v3::socket_address::PortSpecifier::PortValue(p),
                ) => p,
                _ => 0,
            };
            s.address
                .parse::<IpAddr>()
                .is_ok_and(|ip| target.matches(ip, port))
        })
}

/// Where one look at this replica stands.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Look {
    /// Every Envoy holds endpoints without the address.
    Dropped,
    /// The published endpoints still list the address (the source has not said the pod
    /// is going away): in how many resources.
    StillListed(usize),
    /// Published without it; these Envoys do not hold that yet.
    Waiting(Vec<String>),
}

/// One replica's wait: the endpoint resources that listed the address at some point of
/// it, so that an Envoy still holding one of them as it was is waited for.
pub(crate) struct LocalWait {
    target: Target,
    listed: BTreeSet<Arc<str>>,
    /// The version of the last snapshot looked at, and whether it listed the address.
    seen: Option<(String, usize)>,
    /// The address was in no resource at the first look: its removal came earlier, so
    /// every endpoint resource counts.
    gone_before: Option<bool>,
}

impl LocalWait {
    pub(crate) fn new(target: Target) -> LocalWait {
        LocalWait {
            target,
            listed: BTreeSet::new(),
            seen: None,
            gone_before: None,
        }
    }

    /// Looks at `snapshot` and what `clients` hold.
    pub(crate) fn look(&mut self, snapshot: &Snapshot, clients: &Clients) -> Look {
        let still = match &self.seen {
            Some((version, still)) if version == snapshot.version() => *still,
            _ => {
                let with = resources_with(snapshot, self.target);
                let still = with.len();
                self.gone_before.get_or_insert(with.is_empty());
                self.listed.extend(with);
                self.seen = Some((snapshot.version().to_string(), still));
                still
            }
        };
        if still > 0 {
            return Look::StillListed(still);
        }
        let endpoints = snapshot.resources(ResourceType::Endpoints);
        let wanted: Vec<(Arc<str>, Arc<str>)> = endpoints
            .values()
            .filter(|r| self.gone_before == Some(true) || self.listed.contains(&r.name))
            .map(|r| (r.name.clone(), r.version.clone()))
            .collect();
        let lacking = clients.lacking(ResourceType::Endpoints, &wanted);
        if lacking.is_empty() {
            Look::Dropped
        } else {
            Look::Waiting(lacking)
        }
    }
}

/// Waits on this replica until [`Look::Dropped`] or `deadline`; the last look.
pub(crate) async fn wait_local(
    target: Target,
    snapshots: tokio::sync::watch::Receiver<Option<Arc<Snapshot>>>,
    clients: Arc<Clients>,
    deadline: tokio::time::Instant,
) -> Look {
    let mut wait = LocalWait::new(target);
    loop {
        let snapshot = snapshots.borrow().clone();
        let look = match snapshot {
            Some(snapshot) => wait.look(&snapshot, &clients),
            None => Look::StillListed(0),
        };
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
    deadline: tokio::time::Instant,
) -> (bool, String) {
    use http_body_util::{BodyExt, Limited};
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        // An IPv6 endpoint's brackets, percent-encoded: a query may not hold them as is.
        let target = target.to_string().replace('[', "%5B").replace(']', "%5D");
        let uri = format!(
            "http://{address}{PATH}?address={target}&local=true&grace={}ms",
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

/// Asks every address of every peer to wait for its own Envoys (`local=true`), until
/// `deadline`; what each said.
pub(crate) async fn ask_peers(
    peers: &[String],
    target: Target,
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
                let (dropped, detail) = ask_peer(&client, address, target, deadline).await;
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
    use envoy_types::pb::envoy::config::core::v3::{
        address, socket_address, Address, SocketAddress,
    };
    use envoy_types::pb::envoy::config::endpoint::v3::{Endpoint, LbEndpoint, LocalityLbEndpoints};

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

    /// The resources listing a pod's IP (its proxies and replicas, any port), or one
    /// endpoint; a wait sees the pod listed, then dropped once no resource lists it (with
    /// no Envoy connected, nobody lacks anything).
    #[test]
    fn a_wait_follows_the_resources_that_list_the_address() {
        let listed = snapshot(vec![
            assignment("ns/s/a", &["198.18.0.1:8000", "198.18.0.2:8000"]),
            assignment("ns/s/a/app/http", &["198.18.0.2:30001"]),
            assignment("ns/s/b", &["198.18.0.3:8000"]),
        ]);
        let pod = Target::parse("198.18.0.2").unwrap();
        let names: Vec<String> = resources_with(&listed, pod)
            .iter()
            .map(|n| n.to_string())
            .collect();
        assert_eq!(names, ["ns/s/a", "ns/s/a/app/http"]);
        let one = Target::parse("198.18.0.2:30001").unwrap();
        assert_eq!(resources_with(&listed, one).len(), 1);
        assert!(resources_with(&listed, Target::parse("198.18.0.9").unwrap()).is_empty());

        let clients = Clients::default();
        let mut wait = LocalWait::new(pod);
        assert_eq!(wait.look(&listed, &clients), Look::StillListed(2));
        let dropped = snapshot(vec![
            assignment("ns/s/a", &["198.18.0.1:8000"]),
            assignment("ns/s/a/app/http", &[]),
            assignment("ns/s/b", &["198.18.0.3:8000"]),
        ]);
        assert_eq!(wait.look(&dropped, &clients), Look::Dropped);
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
        let ip = Target::parse("198.18.0.7").unwrap();
        assert!(ip.matches("198.18.0.7".parse().unwrap(), 8000));
        assert!(ip.matches("198.18.0.7".parse().unwrap(), 30001));
        assert!(!ip.matches("198.18.0.8".parse().unwrap(), 8000));
        let one = Target::parse("198.18.0.7:8000").unwrap();
        assert!(one.matches("198.18.0.7".parse().unwrap(), 8000));
        assert!(!one.matches("198.18.0.7".parse().unwrap(), 9000));
    }
}
