//! Which addresses ray-xds may publish as a proxy's or an ingress replica's: the
//! [`AddressPolicy`], and why it refuses one ([`AddressRefusal`]).
//!
//! An address [`refused_address`] names is never published, whatever its origin or the
//! configured networks; beyond that, a proxy a dashboard names stays in that dashboard's
//! network, and a replica on its cluster's nodes and in Ray's port range, unless
//! `proxies.networks` says otherwise.

use std::collections::BTreeSet;

use super::Protocol;

/// Cloud metadata services outside link-local ranges: AWS's IPv6 endpoint
/// (`fd00:ec2::254`) and Alibaba Cloud's (`100.100.100.200`).
pub const METADATA_ADDRESSES: [std::net::IpAddr; 2] = [
    std::net::IpAddr::V6(std::net::Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254)),
    std::net::IpAddr::V4(std::net::Ipv4Addr::new(100, 100, 100, 200)),
];

/// Why `address` can never be a Ray Serve proxy's, if it cannot: an address that names
/// no host (unspecified, broadcast, multicast), a link-local one (the cloud metadata
/// service, 169.254.169.254, among them), a cloud metadata service elsewhere
/// ([`METADATA_ADDRESSES`]), or port 0. Such an endpoint is never published, whatever
/// source or dashboard lists it. (Loopback stays allowed: the demo and tests.)
pub fn refused_address(address: std::net::SocketAddr) -> Option<&'static str> {
    use std::net::IpAddr;
    let ip = address.ip();
    if address.port() == 0 {
        return Some("port 0");
    }
    if METADATA_ADDRESSES.contains(&ip) {
        return Some("a cloud metadata service's address");
    }
    if ip.is_unspecified() {
        return Some("an unspecified address");
    }
    if ip.is_multicast() {
        return Some("a multicast address");
    }
    match ip {
        IpAddr::V4(v4) if v4.is_broadcast() => Some("the broadcast address"),
        IpAddr::V4(v4) if v4.is_link_local() => Some("a link-local address"),
        IpAddr::V6(v6) if v6.is_unicast_link_local() => Some("a link-local address"),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => refused_address(std::net::SocketAddr::new(IpAddr::V4(v4), address.port())),
            None => None,
        },
        _ => None,
    }
}

/// Which addresses ray-xds may publish as a proxy's, beyond [`refused_address`].
///
/// With `networks` set, every proxy (listed by the source or discovered) must fall in
/// one of them. Without, a proxy listed by the source is trusted (Kubernetes gives pod
/// IPs; services.yaml is the operator's own file), except a hostNetwork pod's, which is
/// refused (its address is its node's: whoever owns a RayService could publish a node's
/// address, any port on it); and a proxy *discovered* from a dashboard must be in the
/// dashboard's own network ([`dashboard_network`]): a dashboard can name any address,
/// and ray-xds would send traffic there.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AddressPolicy {
    pub networks: Vec<ipnet::IpNet>,
    /// The ports Ray's direct ingress gives ingress replicas ([`AddressPolicy::check_replica`]).
    pub replica_ports: ReplicaPorts,
}

/// The ports Ray's direct ingress allocates to ingress replicas, as its environment sets
/// them (`RAY_SERVE_DIRECT_INGRESS_{MIN,MAX}_{HTTP,GRPC}_PORT`): a replica a dashboard
/// lists outside them is not published.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaPorts {
    pub http: std::ops::RangeInclusive<u16>,
    pub grpc: std::ops::RangeInclusive<u16>,
}

impl Default for ReplicaPorts {
    /// Ray 2.60's defaults: HTTP 30000–31000, gRPC 40000–41000, as Ray's `MIN` and `MAX`
    /// (Ray gives ports from `MIN` up to, not including, `MAX`).
    fn default() -> Self {
        ReplicaPorts {
            http: 30000..=31000,
            grpc: 40000..=41000,
        }
    }
}

impl ReplicaPorts {
    pub(crate) fn of(&self, protocol: Protocol) -> &std::ops::RangeInclusive<u16> {
        match protocol {
            Protocol::Http => &self.http,
            Protocol::Grpc => &self.grpc,
        }
    }
}

/// Where an ingress replica a dashboard lists may be.
#[derive(Debug, Clone, Copy)]
pub enum ReplicaNodes<'a> {
    /// On one of these node addresses: the source lists its cluster's nodes (Kubernetes:
    /// its pods' IPs; services.yaml: its proxies').
    Listed(&'a BTreeSet<std::net::IpAddr>),
    /// The cluster's proxies are discovered: only its dashboard speaks for it (its IP,
    /// when known).
    Dashboard(Option<std::net::IpAddr>),
}

/// Where a proxy's address came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyOrigin {
    /// The source lists it (services.yaml, or a pod's IP in Kubernetes).
    Source,
    /// The source lists it, but as a `hostNetwork` pod's IP: its node's address.
    HostNetwork,
    /// A dashboard listed it; the dashboard's IP address, when known.
    Dashboard(Option<std::net::IpAddr>),
}

/// Why a proxy's address is not published.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AddressRefusal {
    /// [`refused_address`]: never a proxy's.
    Never(&'static str),
    /// Outside every configured network.
    OutsideNetworks,
    /// Discovered, and outside the network of the dashboard that listed it.
    OutsideDashboardNetwork(ipnet::IpNet),
    /// Discovered from a dashboard whose address is unknown.
    DashboardAddressUnknown,
    /// A hostNetwork pod's address (its node's), with no `proxies.networks` to allow it.
    HostNetwork,
    /// A gRPC address that is an HTTP proxy's too (a dashboard reporting one port for
    /// both): an HTTP/1 proxy is never a gRPC one, and probes are keyed by address.
    ProtocolClash,
    /// An ingress replica's port outside the range Ray gives them ([`ReplicaPorts`]).
    OutsideReplicaPorts(Protocol, std::ops::RangeInclusive<u16>),
    /// An ingress replica on an address that is none of its cluster's nodes.
    NotAClusterNode,
    /// An ingress replica's address that another application, cluster or RayService
    /// lists too, or a proxy's: nobody gets it
    /// ([`Model::with_applications`](super::Model::with_applications)).
    ClaimedTwice,
}

impl AddressRefusal {
    /// Every [`label`](Self::label), for metrics that show each one, even at 0.
    pub(crate) const LABELS: [&'static str; 9] = [
        "never_a_proxy",
        "outside_proxy_networks",
        "outside_dashboard_network",
        "dashboard_address_unknown",
        "host_network",
        "protocol_clash",
        "outside_replica_ports",
        "not_a_cluster_node",
        "claimed_twice",
    ];

    /// A short, fixed label (for metrics).
    pub fn label(&self) -> &'static str {
        match self {
            AddressRefusal::Never(_) => "never_a_proxy",
            AddressRefusal::OutsideNetworks => "outside_proxy_networks",
            AddressRefusal::OutsideDashboardNetwork(_) => "outside_dashboard_network",
            AddressRefusal::DashboardAddressUnknown => "dashboard_address_unknown",
            AddressRefusal::HostNetwork => "host_network",
            AddressRefusal::ProtocolClash => "protocol_clash",
            AddressRefusal::OutsideReplicaPorts(..) => "outside_replica_ports",
            AddressRefusal::NotAClusterNode => "not_a_cluster_node",
            AddressRefusal::ClaimedTwice => "claimed_twice",
        }
    }
}

impl std::fmt::Display for AddressRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AddressRefusal::Never(why) => write!(f, "{why} is never a proxy's"),
            AddressRefusal::OutsideNetworks => {
                write!(f, "outside every network of proxies.networks")
            }
            AddressRefusal::OutsideDashboardNetwork(net) => write!(
                f,
                "discovered outside the network of its dashboard ({net}); set proxies.networks to allow it"
            ),
            AddressRefusal::DashboardAddressUnknown => {
                write!(f, "discovered from a dashboard whose address is unknown")
            }
            AddressRefusal::HostNetwork => write!(
                f,
                "a hostNetwork pod's address (its node's); set proxies.networks to allow it"
            ),
            AddressRefusal::ProtocolClash => {
                write!(f, "a gRPC address that is also an HTTP proxy's")
            }
            AddressRefusal::OutsideReplicaPorts(protocol, range) => write!(
                f,
                "an ingress replica's {} port outside {}-{} (Ray's direct ingress ports, from MIN up to, not including, MAX; set proxies.replica_ports to match Ray's)",
                protocol.as_str(),
                range.start(),
                range.end()
            ),
            AddressRefusal::NotAClusterNode => write!(
                f,
                "an ingress replica on none of its cluster's nodes; set proxies.networks to allow it"
            ),
            AddressRefusal::ClaimedTwice => write!(
                f,
                "an ingress replica's address that another application, cluster or RayService lists too, or a proxy's: nobody gets it"
            ),
        }
    }
}

impl AddressPolicy {
    /// Whether `address`, which came from `origin`, may be published.
    pub fn check(
        &self,
        address: std::net::SocketAddr,
        origin: ProxyOrigin,
    ) -> Result<(), AddressRefusal> {
        if let Some(why) = refused_address(address) {
            return Err(AddressRefusal::Never(why));
        }
        let ip = canonical_ip(address.ip());
        if !self.networks.is_empty() {
            return if self
                .networks
                .iter()
                .any(|n| n.contains(&ip) || n.contains(&address.ip()))
            {
                Ok(())
            } else {
                Err(AddressRefusal::OutsideNetworks)
            };
        }
        match origin {
            ProxyOrigin::Source => Ok(()),
            ProxyOrigin::HostNetwork => Err(AddressRefusal::HostNetwork),
            ProxyOrigin::Dashboard(None) => Err(AddressRefusal::DashboardAddressUnknown),
            ProxyOrigin::Dashboard(Some(dashboard)) => {
                let net = dashboard_network(dashboard);
                if net.contains(&ip) {
                    Ok(())
                } else {
                    Err(AddressRefusal::OutsideDashboardNetwork(net))
                }
            }
        }
    }

    /// Whether an ingress replica's `address` for `protocol`, which a dashboard listed,
    /// may be published: never an address [`refused_address`] refuses; its port in Ray's
    /// range for the protocol; on one of its cluster's listed nodes, or within
    /// `networks` when set, or (a cluster whose proxies are discovered, no `networks`) in
    /// its dashboard's network, as a discovered proxy.
    pub(crate) fn check_replica(
        &self,
        address: std::net::SocketAddr,
        protocol: Protocol,
        nodes: ReplicaNodes<'_>,
    ) -> Result<(), AddressRefusal> {
        if let Some(why) = refused_address(address) {
            return Err(AddressRefusal::Never(why));
        }
        let ports = self.replica_ports.of(protocol);
        // As Ray allocates them: `range(MIN, MAX)`, MAX itself never given.
        if !(*ports.start() <= address.port() && address.port() < *ports.end()) {
            return Err(AddressRefusal::OutsideReplicaPorts(protocol, ports.clone()));
        }
        let ip = canonical_ip(address.ip());
        match nodes {
            ReplicaNodes::Listed(nodes) if nodes.contains(&ip) => Ok(()),
            ReplicaNodes::Listed(_) if self.networks.is_empty() => {
                Err(AddressRefusal::NotAClusterNode)
            }
            ReplicaNodes::Listed(_) => self.check(address, ProxyOrigin::Source),
            ReplicaNodes::Dashboard(dashboard) => {
                self.check(address, ProxyOrigin::Dashboard(dashboard))
            }
        }
    }
}

/// An IPv4-mapped IPv6 address as the IPv4 address it maps.
pub fn canonical_ip(ip: std::net::IpAddr) -> std::net::IpAddr {
    match ip {
        std::net::IpAddr::V6(v6) => v6.to_ipv4_mapped().map(std::net::IpAddr::V4).unwrap_or(ip),
        v4 => v4,
    }
}

/// The network a dashboard's proxies are expected in when no networks are configured:
/// the /16 around its IPv4 address (a Kubernetes pod network, or a LAN of Ray nodes,
/// is rarely narrower), or the /64 around its IPv6 address.
pub fn dashboard_network(dashboard: std::net::IpAddr) -> ipnet::IpNet {
    let (ip, prefix) = match canonical_ip(dashboard) {
        ip @ std::net::IpAddr::V4(_) => (ip, 16),
        ip @ std::net::IpAddr::V6(_) => (ip, 64),
    };
    ipnet::IpNet::new(ip, prefix)
        .expect("16 and 64 are valid prefixes")
        .trunc()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;

    fn a(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    fn dashboard(ip: &str) -> ProxyOrigin {
        ProxyOrigin::Dashboard(Some(ip.parse().unwrap()))
    }

    #[test]
    fn a_replica_passes_the_address_policy_by_its_node_and_its_port() {
        let p = AddressPolicy::default();
        let nodes: BTreeSet<std::net::IpAddr> = ["10.0.0.1".parse().unwrap()].into();
        let at = |s: &str| s.parse::<SocketAddr>().unwrap();
        let listed = ReplicaNodes::Listed(&nodes);
        assert_eq!(
            p.check_replica(at("10.0.0.1:30000"), Protocol::Http, listed),
            Ok(())
        );
        assert_eq!(
            p.check_replica(at("10.0.0.1:40999"), Protocol::Grpc, listed),
            Ok(())
        );
        // Ray gives ports from MIN up to, not including, MAX.
        for (address, protocol) in [
            ("10.0.0.1:41000", Protocol::Grpc),
            ("10.0.0.1:31000", Protocol::Http),
        ] {
            assert_eq!(
                p.check_replica(at(address), protocol, listed)
                    .map_err(|e| e.label()),
                Err("outside_replica_ports"),
                "{address}"
            );
        }
        assert_eq!(
            p.check_replica(at("10.0.0.1:40000"), Protocol::Http, listed)
                .map_err(|e| e.label()),
            Err("outside_replica_ports")
        );
        assert_eq!(
            p.check_replica(at("10.0.0.2:30000"), Protocol::Http, listed)
                .map_err(|e| e.label()),
            Err("not_a_cluster_node")
        );
        assert_eq!(
            p.check_replica(at("169.254.169.254:30000"), Protocol::Http, listed)
                .map_err(|e| e.label()),
            Err("never_a_proxy")
        );
        let dashboard = ReplicaNodes::Dashboard(Some("10.0.9.9".parse().unwrap()));
        assert_eq!(
            p.check_replica(at("10.0.0.2:30000"), Protocol::Http, dashboard),
            Ok(())
        );
        assert_eq!(
            p.check_replica(at("10.1.0.2:30000"), Protocol::Http, dashboard)
                .map_err(|e| e.label()),
            Err("outside_dashboard_network")
        );
        let networks = AddressPolicy {
            networks: vec!["10.0.0.0/24".parse().unwrap()],
            ..Default::default()
        };
        assert_eq!(
            networks.check_replica(at("10.0.0.2:30000"), Protocol::Http, listed),
            Ok(())
        );
        assert_eq!(
            networks
                .check_replica(at("10.0.1.2:30000"), Protocol::Http, listed)
                .map_err(|e| e.label()),
            Err("outside_proxy_networks")
        );
    }

    #[test]
    fn never_a_proxy_whatever_the_origin_or_networks() {
        let open = AddressPolicy {
            networks: vec!["0.0.0.0/0".parse().unwrap(), "::/0".parse().unwrap()],
            ..Default::default()
        };
        for bad in [
            "169.254.169.254:80",
            "0.0.0.0:8000",
            "255.255.255.255:8000",
            "224.0.0.1:8000",
            "[::]:8000",
            "[fe80::1]:8000",
            "[::ffff:169.254.169.254]:80",
            "[fd00:ec2::254]:80",
            "100.100.100.200:80",
            "10.0.0.1:0",
        ] {
            for policy in [&AddressPolicy::default(), &open] {
                for origin in [
                    ProxyOrigin::Source,
                    ProxyOrigin::HostNetwork,
                    dashboard("169.254.0.1"),
                ] {
                    assert!(
                        matches!(policy.check(a(bad), origin), Err(AddressRefusal::Never(_))),
                        "{bad} {origin:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn without_networks_discovered_proxies_stay_in_their_dashboards_network() {
        let p = AddressPolicy::default();
        assert_eq!(p.check(a("10.1.200.7:8000"), dashboard("10.1.0.5")), Ok(()));
        assert_eq!(
            p.check(a("10.2.0.7:8000"), dashboard("10.1.0.5")),
            Err(AddressRefusal::OutsideDashboardNetwork(
                "10.1.0.0/16".parse().unwrap()
            ))
        );
        // IPv4-mapped addresses count as the IPv4 address.
        assert_eq!(
            p.check(a("[::ffff:10.1.3.4]:8000"), dashboard("10.1.0.5")),
            Ok(())
        );
        assert_eq!(
            p.check(a("10.1.3.4:8000"), dashboard("::ffff:10.1.0.5")),
            Ok(())
        );
        // IPv6: the /64.
        assert_eq!(p.check(a("[fd00::1:2]:8000"), dashboard("fd00::9")), Ok(()));
        assert!(p
            .check(a("[fd00:0:0:1::2]:8000"), dashboard("fd00::9"))
            .is_err());
        assert_eq!(
            p.check(a("127.0.0.3:8000"), ProxyOrigin::Dashboard(None)),
            Err(AddressRefusal::DashboardAddressUnknown)
        );
        // What the source lists is trusted.
        assert_eq!(p.check(a("203.0.113.9:8000"), ProxyOrigin::Source), Ok(()));
    }

    #[test]
    fn every_refusal_label_is_listed() {
        for r in [
            AddressRefusal::Never("x"),
            AddressRefusal::OutsideNetworks,
            AddressRefusal::OutsideDashboardNetwork("10.0.0.0/16".parse().unwrap()),
            AddressRefusal::DashboardAddressUnknown,
            AddressRefusal::HostNetwork,
            AddressRefusal::ProtocolClash,
        ] {
            assert!(AddressRefusal::LABELS.contains(&r.label()), "{r:?}");
        }
    }

    /// A hostNetwork pod's podIP is its node's address; without
    /// `proxies.networks` it is refused (a RayService owner could otherwise publish a
    /// node's address, any port on it), and with them it is checked like any other.
    #[test]
    fn a_host_network_pods_address_needs_configured_networks() {
        let open = AddressPolicy::default();
        for addr in [
            "10.0.0.7:8000",
            "203.0.113.9:22",
            "127.0.0.1:8000",
            "[fd00::7]:8000",
        ] {
            assert_eq!(
                open.check(a(addr), ProxyOrigin::HostNetwork),
                Err(AddressRefusal::HostNetwork),
                "{addr}"
            );
            // The same address listed by the source as a pod's own is trusted.
            assert_eq!(open.check(a(addr), ProxyOrigin::Source), Ok(()), "{addr}");
        }
        let why = AddressRefusal::HostNetwork.to_string();
        assert!(
            why.contains("hostNetwork") && why.contains("proxies.networks"),
            "{why}"
        );
        let nodes = AddressPolicy {
            networks: vec!["10.0.0.0/24".parse().unwrap()],
            ..Default::default()
        };
        assert_eq!(
            nodes.check(a("10.0.0.7:8000"), ProxyOrigin::HostNetwork),
            Ok(())
        );
        assert_eq!(
            nodes.check(a("10.0.1.7:8000"), ProxyOrigin::HostNetwork),
            Err(AddressRefusal::OutsideNetworks)
        );
        assert_eq!(
            nodes.check(a("169.254.169.254:80"), ProxyOrigin::HostNetwork),
            Err(AddressRefusal::Never("a link-local address"))
        );
    }

    #[test]
    fn configured_networks_bind_every_proxy() {
        let p = AddressPolicy {
            networks: vec!["10.0.0.0/8".parse().unwrap(), "fd00::/8".parse().unwrap()],
            ..Default::default()
        };
        for origin in [
            ProxyOrigin::Source,
            ProxyOrigin::HostNetwork,
            dashboard("192.0.2.1"),
        ] {
            assert_eq!(p.check(a("10.200.0.1:8000"), origin), Ok(()));
            assert_eq!(p.check(a("[fd12::1]:8000"), origin), Ok(()));
            assert_eq!(p.check(a("[::ffff:10.0.0.1]:8000"), origin), Ok(()));
            assert_eq!(
                p.check(a("192.0.2.1:8000"), origin),
                Err(AddressRefusal::OutsideNetworks)
            );
        }
    }
}
