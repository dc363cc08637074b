//! Hostile review of "Replicas that agree" (`live::peers`, `pipeline::switchover`,
//! `pipeline::departed`): peers that lie, skew, echo, flood or hang.
//!
//! Written by a hostile reviewer; every test passes only when ray-xds behaves safely.
//! Four failed when written (a restarted replica serving an early-flipped, unready active
//! cluster; thousands of departed clusters taken from one peer; a peer's departed cluster
//! un-withholding a live, unprobed proxy; a skewed peer skipping the canary): each comment
//! says what was wrong, and all four are fixed. The others guard attacks ray-xds survived.

// A test is a scenario read top to bottom: its steps stay in one function.
#![allow(clippy::too_many_lines)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use ray_xds::live::dashboards::DashboardStates;
use ray_xds::live::health::{assess, Facts};
use ray_xds::live::peers::{
    to_unix, DepartedCluster, DepartedProxy, PeerStates, PeerSwitch, ReplicaView,
};
use ray_xds::live::probe::{ProbeState, ProxyProbe};
use ray_xds::live::prober::ProbeStates;
use ray_xds::model::{
    AddressPolicy, Model, NodeType as MNodeType, Proxy, RayCluster, RayService, ServicePolicy,
};
use ray_xds::pipeline::departed::Departed;
use ray_xds::pipeline::switchover::{EnvoyWarmth, Switchover};
use ray_xds::policy::switchover::{SwitchoverOverrides, SwitchoverPolicy};
use ray_xds::policy::Steps;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

// ---------------------------------------------------------------------------------------
// Pure helpers: one RayService `default/s`, clusters a (10.0.0.1:8000) and b (10.0.0.2:8000),
// no dashboards (readiness = probes).

const SVC: &str = "default/s";

fn proxy(ip: [u8; 4]) -> Proxy {
    Proxy {
        address: SocketAddr::from((ip, 8000)),
        node_type: MNodeType::Head,
        grpc: None,
        draining: false,
        host_network: false,
    }
}

fn cluster(name: &str, ip: [u8; 4]) -> RayCluster {
    RayCluster {
        name: name.into(),
        dashboard: None,
        grpc_port: None,
        discover: false,
        direct_ingress: false,
        applications: Vec::new(),
        proxies: vec![proxy(ip)],
    }
}

fn service(
    name: &str,
    active: &str,
    pending: Option<&str>,
    clusters: Vec<RayCluster>,
) -> RayService {
    RayService {
        namespace: "default".into(),
        name: name.into(),
        hosts: vec![format!("{name}.example")],
        active_cluster: active.into(),
        pending_cluster: pending.map(str::to_string),
        pending_traffic_cap: None,
        clusters,
        policy: ServicePolicy::default(),
    }
}

fn progressive() -> SwitchoverOverrides {
    SwitchoverOverrides {
        steps: Some(Steps(vec![10, 25, 50, 100])),
        interval: Some(Duration::from_secs(10)),
        ..Default::default()
    }
}

fn model(active: &str, pending: Option<&str>, policy: SwitchoverOverrides) -> Model {
    let mut s = service(
        "s",
        active,
        pending,
        vec![cluster("a", [10, 0, 0, 1]), cluster("b", [10, 0, 0, 2])],
    );
    s.policy.overrides.switchover = policy;
    Model::new(vec![s]).unwrap()
}

/// Probes: a healthy, b as given.
fn probes(b: ProbeState) -> ProbeStates {
    let mut p = ProbeStates::default();
    for (ip, state) in [([10, 0, 0, 1], ProbeState::Healthy), ([10, 0, 0, 2], b)] {
        let mut probe = ProxyProbe::new(SystemTime::UNIX_EPOCH);
        probe.state = state;
        probe.routes = Some(Arc::new(["/".to_string()].into()));
        p.proxies.insert(SocketAddr::from((ip, 8000)), probe);
    }
    p.complete = true;
    p
}

fn step(s: &mut Switchover, m: &Model, b: ProbeState, envoys: &dyn EnvoyWarmth, now: SystemTime) {
    let dashboards = DashboardStates::default();
    let health = assess(m, &probes(b), &dashboards, Facts::default());
    s.advance(m, &health, &dashboards, envoys, now);
}

fn weight(s: &Switchover, c: &str) -> u32 {
    s.weights()[SVC]
        .iter()
        .find(|(n, _)| n == c)
        .map(|(_, w)| *w)
        .unwrap_or(0)
}

fn peers(switch: PeerSwitch) -> Arc<PeerStates> {
    Arc::new(PeerStates {
        services: BTreeMap::from([(SVC.to_string(), vec![switch])]),
        polled: true,
        ..Default::default()
    })
}

fn completed_b() -> PeerSwitch {
    PeerSwitch {
        serving: "b".into(),
        target: None,
        target_since_unix: None,
        shift_started_unix: None,
        serving_since_unix: Some(1.0),
        moved: true,
        moved_from: None,
        rollback: None,
        held_at: None,
    }
}

/// Every Envoy cold for every cluster.
struct Cold;
impl EnvoyWarmth for Cold {
    fn cold_envoys(&self, _: &str) -> Vec<String> {
        vec!["envoy-1".into()]
    }
    fn rejecting_envoys(&self, _: &str) -> Vec<String> {
        Vec::new()
    }
}

const T0: SystemTime = SystemTime::UNIX_EPOCH;
fn at(secs: u64) -> SystemTime {
    T0 + Duration::from_secs(1_700_000_000 + secs)
}

// ---------------------------------------------------------------------------------------
// Gates: a peer's word never opens one.

/// SURVIVED: a hostile peer claiming it completed the move to b (serving b) moves nothing
/// while b is not ready here, nor while this replica's Envoys have not warmed it.
#[test]
fn a_peer_claiming_completed_opens_neither_readiness_nor_warmth() {
    let m = model("a", Some("b"), progressive());
    let mut s = Switchover::new(SwitchoverPolicy::default());
    s.set_peers(peers(completed_b()));
    for state in [
        ProbeState::Unknown,
        ProbeState::Unhealthy,
        ProbeState::Draining,
    ] {
        step(&mut s, &m, state, &(), at(0));
        assert_eq!(weight(&s, "b"), 0, "b {state:?} here: no traffic");
    }
    // Ready here but cold on an Envoy (within warm_timeout): still nothing.
    step(&mut s, &m, ProbeState::Healthy, &Cold, at(1));
    assert_eq!(weight(&s, "b"), 0, "b not warmed by this replica's Envoys");
    // Ready and warm: the peer may hurry it (documented).
    step(&mut s, &m, ProbeState::Healthy, &(), at(2));
    assert_eq!(weight(&s, "b"), 100);
}

/// SURVIVED: a peer's shift start (even hours old) for a target that is not ready here
/// moves nothing, and a peer's shift of another move (wrong serving cluster) is ignored.
#[test]
fn a_peer_shift_for_an_unready_target_or_another_move_moves_nothing() {
    let m = model("a", Some("b"), progressive());
    let mut s = Switchover::new(SwitchoverPolicy::default());
    s.set_peers(peers(PeerSwitch {
        serving: "a".into(),
        target: Some("b".into()),
        target_since_unix: Some(1.0),
        shift_started_unix: Some(1.0),
        serving_since_unix: Some(1.0),
        moved: false,
        moved_from: None,
        rollback: None,
        held_at: None,
    }));
    step(&mut s, &m, ProbeState::Unhealthy, &(), at(0));
    assert_eq!(weight(&s, "b"), 0);
    // Another move (serving c → b) started long ago: not ours.
    let mut s = Switchover::new(SwitchoverPolicy::default());
    s.set_peers(peers(PeerSwitch {
        serving: "c".into(),
        target: Some("b".into()),
        target_since_unix: Some(1.0),
        shift_started_unix: Some(1.0),
        serving_since_unix: Some(1.0),
        moved: false,
        moved_from: None,
        rollback: None,
        held_at: None,
    }));
    step(&mut s, &m, ProbeState::Healthy, &(), at(0));
    assert_eq!(
        weight(&s, "b"),
        10,
        "first step, the other move's start ignored"
    );
}

/// SURVIVED: a peer flip-flopping every poll (shift started long ago / no shift / a
/// future start) never makes the weights go backwards or flap.
#[test]
fn a_flip_flopping_peer_does_not_make_weights_flap() {
    let m = model("a", Some("b"), progressive());
    let mut s = Switchover::new(SwitchoverPolicy::default());
    step(&mut s, &m, ProbeState::Healthy, &(), at(0));
    assert_eq!(weight(&s, "b"), 10);
    let early = PeerSwitch {
        serving: "a".into(),
        target: Some("b".into()),
        target_since_unix: Some(to_unix(at(0)) - 12.0),
        shift_started_unix: Some(to_unix(at(0)) - 12.0),
        serving_since_unix: Some(1.0),
        moved: false,
        moved_from: None,
        rollback: None,
        held_at: None,
    };
    let future = PeerSwitch {
        shift_started_unix: Some(to_unix(at(0)) + 3600.0),
        ..early.clone()
    };
    let mut last = 10;
    for i in 0..20u64 {
        let view = match i % 3 {
            0 => peers(early.clone()),
            1 => Arc::new(PeerStates {
                polled: true,
                ..Default::default()
            }),
            _ => peers(future.clone()),
        };
        s.set_peers(view);
        step(
            &mut s,
            &m,
            ProbeState::Healthy,
            &(),
            at(0) + Duration::from_millis(500 * i),
        );
        let w = weight(&s, "b");
        assert!(w >= last, "poll {i}: weight went back from {last} to {w}");
        last = w;
    }
    // The earliest start (12 s before at(0)) is taken once and kept, whatever the peer
    // says next: at at(0)+9.5 s, 21.5 s in, the third step.
    assert_eq!(last, 50, "the earliest start taken once, kept");
}

/// FINDING (high): a replica (re)started while KubeRay has flipped `active_cluster` early
/// (or replaced a cluster after losing its head) serves the new active cluster at 100% at
/// once, unready, although its peers report they still serve `a` with `b` as the target.
/// Worse, it then reports `serving: b, target: none`, which the peers take as "a peer has
/// completed the move": they jump straight to 100% (skipping every progressive step) as
/// soon as their own gates pass.
///
/// Safe: a replica with no state of its own for a RayService starts from the cluster its
/// peers serve (when the source still lists it), with the source's active cluster as the
/// target, gated on readiness and warmth like any other switch; and it never reports
/// itself "completed" for a move it did not make.
#[test]
fn a_restarted_replica_does_not_serve_an_unready_early_flipped_active_cluster() {
    // The source already names b active (early flip); b is not ready.
    let m = model("b", None, progressive());
    let mut s = Switchover::new(SwitchoverPolicy::default());
    s.set_peers(peers(PeerSwitch {
        serving: "a".into(),
        target: Some("b".into()),
        target_since_unix: Some(to_unix(at(0)) - 5.0),
        shift_started_unix: None,
        serving_since_unix: Some(1.0),
        moved: false,
        moved_from: None,
        rollback: None,
        held_at: None,
    }));
    step(&mut s, &m, ProbeState::Unhealthy, &(), at(0));
    assert_eq!(
        weight(&s, "b"),
        0,
        "b is not ready here and the peers serve a: it must get no traffic (weights {:?})",
        s.weights()
    );
    let view = s.replica_view();
    assert!(
        !(view.services[SVC].serving == "b" && view.services[SVC].target.is_none()),
        "must not tell its peers it completed a move to b it never made: {:?}",
        view.services[SVC]
    );
}

/// FINDING (medium): a peer whose clock is hours behind (or a peer that lies) reports a
/// shift start hours ago; this replica, which has itself watched b become the target a
/// minute ago and found it ready just now, jumps to 100% at once: the whole progressive
/// canary (10/25/50%) is skipped on one replica because one node's NTP is broken.
///
/// Safe: a peer's shift start earlier than when this replica itself saw the switch begin
/// (its own `target_since`, which every replica sees within seconds of the others) is
/// not a start any replica could have seen: it is left out (and logged). For a freshly
/// restarted replica, the answer should carry the peer's clock so a skewed peer's times
/// are left out.
#[test]
fn a_peer_start_hours_before_the_switch_existed_does_not_skip_the_canary() {
    let m_before = model("a", None, progressive());
    let m = model("a", Some("b"), progressive());
    let mut s = Switchover::new(SwitchoverPolicy::default());
    step(&mut s, &m_before, ProbeState::Healthy, &(), at(0));
    // b appears, not ready yet: this replica knows the switch began at 60.
    step(&mut s, &m, ProbeState::Unhealthy, &(), at(60));
    assert_eq!(weight(&s, "b"), 0);
    // A peer 3 hours behind.
    let skew = 3.0 * 3600.0;
    s.set_peers(peers(PeerSwitch {
        serving: "a".into(),
        target: Some("b".into()),
        target_since_unix: Some(to_unix(at(60)) - skew),
        shift_started_unix: Some(to_unix(at(100)) - skew),
        serving_since_unix: Some(1.0),
        moved: false,
        moved_from: None,
        rollback: None,
        held_at: None,
    }));
    step(&mut s, &m, ProbeState::Healthy, &(), at(120));
    assert_eq!(
        weight(&s, "b"),
        10,
        "first step of the canary, not {:?}",
        s.weights()
    );
}

// ---------------------------------------------------------------------------------------
// Departed clusters taken from peers.

fn departed(service: &str, cluster: &str, until: SystemTime, ips: &[[u8; 4]]) -> DepartedCluster {
    DepartedCluster {
        service: service.into(),
        cluster: cluster.into(),
        until_unix: to_unix(until),
        proxies: ips
            .iter()
            .map(|ip| DepartedProxy {
                address: SocketAddr::from((*ip, 8000)),
                grpc: None,
                head: false,
            })
            .collect(),
    }
}

/// SURVIVED: two replicas echoing a departed cluster back and forth never extend it:
/// each keeps the first end, and once it passes neither takes it again (even from a
/// stale answer). Far-future and past ends are refused outright.
#[test]
fn departed_clusters_echoed_between_replicas_expire_at_the_first_end() {
    let policy = SwitchoverPolicy::default();
    let addresses = AddressPolicy::default();
    let before = model("a", None, Default::default());
    let mut after = before.services()[0].clone();
    after.clusters.retain(|c| c.name == "a");
    after.active_cluster = "a".into();
    let after = Model::new(vec![after]).unwrap();

    let mut one = Departed::default();
    one.update(&before, &after, &policy, at(0));
    let end = one.next_expiry().unwrap();
    let mut two = Departed::default();
    let mut now = at(1);
    // Many rounds of each adopting the other's view, up to and past the end.
    while now < at(120) {
        two.adopt(&one.view(), &after, &policy, &addresses, now);
        two.update(&after, &after, &policy, now);
        let echoed = two.view();
        one.adopt(&echoed, &after, &policy, &addresses, now);
        one.update(&after, &after, &policy, now);
        for d in [&one, &two] {
            if let Some(e) = d.next_expiry() {
                assert!(e <= end, "extended from {end:?} to {e:?}");
            }
        }
        now += Duration::from_millis(500);
    }
    assert!(one.view().is_empty() && two.view().is_empty());
    // A stale answer replayed after the end is not taken.
    let stale = vec![departed(SVC, "b", end, &[[10, 0, 0, 2]])];
    two.adopt(&stale, &after, &policy, &addresses, at(200));
    assert!(two.view().is_empty());
    // Garbage ends.
    for until in [f64::NAN, f64::INFINITY, -1.0, 1e300, to_unix(at(200)) + 1e6] {
        let mut d = Departed::default();
        let mut v = stale.clone();
        v[0].until_unix = until;
        d.adopt(&v, &after, &policy, &addresses, at(200));
        assert!(d.view().is_empty(), "{until}");
    }
}

/// SURVIVED: a peer cannot make this replica drain a cluster under the name of a live
/// one, for a RayService the source lacks, or at metadata/link-local/unspecified
/// addresses; what is adopted only drains.
#[test]
fn departed_clusters_from_a_peer_cannot_shadow_or_point_at_forbidden_addresses() {
    let policy = SwitchoverPolicy::default();
    let addresses = AddressPolicy::default();
    let m = model("a", None, Default::default());
    let now = at(0);
    let until = now + Duration::from_secs(10);
    let mut d = Departed::default();
    d.adopt(
        &[
            departed(SVC, "a", until, &[[1, 2, 3, 4]]),
            departed("default/nope", "x", until, &[[1, 2, 3, 4]]),
            departed(
                SVC,
                "meta",
                until,
                &[[169, 254, 169, 254], [0, 0, 0, 0], [255, 255, 255, 255]],
            ),
        ],
        &m,
        &policy,
        &addresses,
        now,
    );
    assert!(!d.contains(SVC, "a"));
    assert!(!d.contains("default/nope", "x"));
    assert!(d.addresses().is_empty(), "{:?}", d.addresses());
    // Whatever is adopted only drains.
    let mut d = Departed::default();
    d.adopt(
        &[departed(SVC, "old", until, &[[10, 9, 9, 9]])],
        &m,
        &policy,
        &addresses,
        now,
    );
    let kept = d.update(&m, &m, &policy, now);
    let old = kept.services()[0].cluster("old").expect("adopted");
    assert!(old.proxies.iter().all(|p| p.draining));
}

/// FINDING (high, DoS amplification): nothing bounds how many clusters a peer can make this
/// replica adopt. One answer within the 4 MiB limit names ~40,000 departed clusters of an
/// existing RayService (each with one proxy passing the default address policy); every
/// one is adopted, added to the model and published to every Envoy as a cluster (CDS/EDS),
/// re-validated on every build, and echoed to the other peers for the grace period.
/// Here 5,000 are enough to show it.
///
/// Safe: a bound on what a peer can add, e.g. at most a few departed clusters per
/// RayService (a switchover departs one at a time) and a total cap, the rest left out and
/// logged once.
#[test]
fn a_peer_cannot_make_this_replica_publish_thousands_of_departed_clusters() {
    let policy = SwitchoverPolicy::default();
    let m = model("a", None, Default::default());
    let now = at(0);
    let until = now + Duration::from_secs(25);
    let flood: Vec<DepartedCluster> = (0..5000u32)
        .map(|i| {
            departed(
                SVC,
                &format!("x{i}"),
                until,
                &[[10, 100, (i / 250) as u8, (i % 250) as u8 + 1]],
            )
        })
        .collect();
    let mut d = Departed::default();
    let started = Instant::now();
    d.adopt(&flood, &m, &policy, &AddressPolicy::default(), now);
    let kept = d.update(&m, &m, &policy, now);
    let n = kept.services()[0].clusters.len();
    eprintln!(
        "adopted: model has {n} clusters (adopt+update took {:?})",
        started.elapsed()
    );
    assert!(
        n <= 64,
        "a single peer answer made this replica publish {n} clusters"
    );
}

/// SURVIVED: an adopted cluster whose proxy address is a live proxy of ANOTHER
/// RayService (another tenant's, or a pod IP Kubernetes reused within the grace) does not
/// invalidate the merged model: this replica's own drains stay. (The same address still
/// opens the first-probe gate: see
/// `a_peer_departed_cluster_cannot_unwithhold_a_live_unprobed_proxy`.)
#[test]
fn an_adopted_cluster_clashing_with_another_rayservice_does_not_cut_every_drain() {
    let policy = SwitchoverPolicy::default();
    let s1_before = service(
        "s",
        "a",
        None,
        vec![cluster("a", [10, 0, 0, 1]), cluster("old", [10, 0, 0, 3])],
    );
    let s1_after = service("s", "a", None, vec![cluster("a", [10, 0, 0, 1])]);
    let other = service("t", "c", None, vec![cluster("c", [10, 0, 0, 7])]);
    let before = Model::new(vec![s1_before, other.clone()]).unwrap();
    let after = Model::new(vec![s1_after, other]).unwrap();
    let mut d = Departed::default();
    let m = d.update(&before, &after, &policy, at(0));
    let s = m.services().iter().find(|s| s.name == "s").unwrap();
    assert!(s.cluster("old").is_some(), "own drain kept");

    // A peer reports a departed cluster of s at the other tenant's live proxy.
    d.adopt(
        &[departed(SVC, "evil", at(20), &[[10, 0, 0, 7]])],
        &after,
        &policy,
        &AddressPolicy::default(),
        at(1),
    );
    let m = d.update(&after, &after, &policy, at(1));
    let s = m.services().iter().find(|s| s.name == "s").unwrap();
    assert!(
        s.cluster("old").is_some(),
        "this replica's own drain of `old` must survive a peer's clashing cluster"
    );
}

// ---------------------------------------------------------------------------------------
// The wire: peers that answer garbage, too much, too slowly, or not at all.

/// A fake peer: answers every connection with `answer` (raw HTTP), counting requests.
async fn fake_peer(
    answer: Arc<dyn Fn() -> Vec<u8> + Send + Sync>,
    hang: bool,
) -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let count = Arc::new(AtomicUsize::new(0));
    let c = count.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            let answer = answer.clone();
            let c = c.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let _ = stream.read(&mut buf).await;
                c.fetch_add(1, Ordering::SeqCst);
                let _ = stream.write_all(&answer()).await;
                if hang {
                    // Headers (and maybe part of a body), then nothing, connection open.
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                }
                let _ = stream.shutdown().await;
            });
        }
    });
    (addr, count)
}

fn http_ok(body: &[u8]) -> Vec<u8> {
    let mut r = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(body);
    r
}

fn view_json(v: &ReplicaView) -> Vec<u8> {
    serde_json::to_vec(v).unwrap()
}

async fn weights_and_phase(admin: SocketAddr) -> Option<(u32, String)> {
    let (ready, _) = http_get(&format!("http://{admin}/readyz")).await.ok()?;
    if ready != 200 {
        return None;
    }
    let (_, metrics) = http_get(&format!("http://{admin}/metrics")).await.ok()?;
    let w = metric(
        &metrics,
        "ray_xds_switchover_weight{rayservice=\"default/demo\",cluster=\"b\"}",
    );
    let (_, state) = http_get(&format!("http://{admin}/debug/state"))
        .await
        .ok()?;
    let phase = state
        .split("\"phase\":\"")
        .nth(1)
        .map(|s| s.split('"').next().unwrap_or("").to_string())
        .unwrap_or_default();
    Some((w as u32, phase))
}

/// SURVIVED (mostly): a replica whose peers answer garbage JSON, HTTP 500, a redirect (to
/// the hostile peer), a body over 4 MiB, headers then nothing (slow loris), an
/// unresolvable name, itself, and a hostile peer claiming it completed the move to b
/// (unready here): it starts and publishes promptly, keeps answering its own
/// `/replica/switchover`, and b gets no traffic while it is not ready, however many times
/// the hostile peer was heard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_slow_huge_and_lying_peers_are_left_out_and_open_no_gate() {
    let a = SimCluster::start("a", &[ray_serve_sim::NodeType::Head]).await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("services.yaml");
    // b: a proxy at a port nothing listens on (never ready).
    let dead = free_port();
    let text = services_yaml_with(
        "a",
        &[&a],
        "    pending_cluster: b\n    switchover: { mode: progressive, steps: [10, 25, 50, 100], interval: 1s }\n",
    ) + &format!("      - name: b\n        proxies:\n          - {{ address: 127.0.0.1:{dead}, node_type: head }}\n");
    write_atomic(&file, &text);

    let liar_view = ReplicaView {
        services: BTreeMap::from([(
            "default/demo".to_string(),
            PeerSwitch {
                serving: "b".into(),
                target: None,
                target_since_unix: Some(1.0),
                shift_started_unix: Some(1.0),
                serving_since_unix: Some(1.0),
                // The liar claims a move done.
                moved: true,
                moved_from: None,
                rollback: None,
                held_at: None,
            },
        )]),
        departed: vec![],
        now_unix: None,
        replica: None,
        loads: Default::default(),
    };
    let liar_body = view_json(&liar_view);
    let (liar, liar_count) = fake_peer(Arc::new(move || http_ok(&liar_body)), false).await;
    let (garbage, garbage_count) = fake_peer(
        Arc::new(|| http_ok(b"{\"services\": [1,2,3], \"departed\": nul")),
        false,
    )
    .await;
    let (five_hundred, _) = fake_peer(
        Arc::new(|| {
            b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                .to_vec()
        }),
        false,
    )
    .await;
    let redirect_to = liar;
    let (redirect, _) = fake_peer(
        Arc::new(move || {
            format!("HTTP/1.1 302 Found\r\nlocation: http://{redirect_to}/replica/switchover\r\ncontent-length: 0\r\nconnection: close\r\n\r\n").into_bytes()
        }),
        false,
    )
    .await;
    let huge: Arc<Vec<u8>> = Arc::new({
        // 5 MiB of valid JSON whitespace inside an object.
        let mut b = b"{\"services\":{}".to_vec();
        b.extend(std::iter::repeat_n(b' ', 5 * 1024 * 1024));
        b.extend_from_slice(b"}");
        http_ok(&b)
    });
    let (huge_peer, huge_count) = fake_peer(Arc::new(move || huge.to_vec()), false).await;
    let (loris, loris_count) = fake_peer(
        Arc::new(|| {
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100000\r\n\r\n{\"services\":"
                .to_vec()
        }),
        true,
    )
    .await;

    let admin = free_port();
    let mut config = test_config(&file, 0);
    config.admin_listen = SocketAddr::from(([127, 0, 0, 1], admin));
    config.replica_poll_interval = Duration::from_millis(200);
    config.replica_peers = vec![
        liar.to_string(),
        garbage.to_string(),
        five_hundred.to_string(),
        redirect.to_string(),
        huge_peer.to_string(),
        loris.to_string(),
        "no-such-peer.invalid:19000".to_string(),
        format!("127.0.0.1:{admin}"),
    ];
    let started = Instant::now();
    let running = ray_xds::runtime::start(config, Default::default())
        .await
        .expect("starts whatever its peers do");
    let admin = running.admin_addr;
    let (w, _) = eventually("the replica publishes", Duration::from_secs(20), || {
        weights_and_phase(admin)
    })
    .await;
    let first_publish = started.elapsed();
    eprintln!("first publish after {first_publish:?}");
    assert_eq!(w, 0);
    // Every kind of peer has been asked several times since.
    let base = (
        liar_count.load(Ordering::SeqCst),
        garbage_count.load(Ordering::SeqCst),
        huge_count.load(Ordering::SeqCst),
    );
    eventually(
        "each peer asked 5 more times",
        Duration::from_secs(30),
        || {
            let ok = liar_count.load(Ordering::SeqCst) >= base.0 + 5
                && garbage_count.load(Ordering::SeqCst) >= base.1 + 5
                && huge_count.load(Ordering::SeqCst) >= base.2 + 5;
            async move { ok.then_some(()) }
        },
    )
    .await;
    assert!(loris_count.load(Ordering::SeqCst) >= 1);
    let (w, phase) = weights_and_phase(admin).await.expect("still serving");
    assert_eq!(
        w, 0,
        "b is not ready here: the liar's 'completed' moves nothing"
    );
    assert_eq!(phase, "waiting");
    let (status, body) = http_get(&format!("http://{admin}/replica/switchover"))
        .await
        .unwrap();
    assert_eq!(status, 200);
    let own: ReplicaView = serde_json::from_str(&body).unwrap();
    assert_eq!(own.services["default/demo"].serving, "a");
    assert_eq!(own.services["default/demo"].target.as_deref(), Some("b"));
    running.stop().await.unwrap();
}

/// SURVIVED: a restarted replica whose only peer accepts connections and never answers
/// (or is down) does not hang its start: it publishes within a few seconds (the first
/// build waits at most ~1.2 s for peers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackholed_peer_delays_the_first_publish_by_at_most_about_a_second() {
    let a = SimCluster::start("a", &[ray_serve_sim::NodeType::Head]).await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("services.yaml");
    write_atomic(&file, &services_yaml_with("a", &[&a], ""));
    // Accepts, reads, never writes.
    let (silent, _) = fake_peer(Arc::new(Vec::new), true).await;
    let mut config = test_config(&file, 0);
    config.replica_peers = vec![silent.to_string()];
    let started = Instant::now();
    let running = ray_xds::runtime::start(config, Default::default())
        .await
        .unwrap();
    let admin = running.admin_addr;
    eventually("ready", Duration::from_secs(15), || async move {
        let (s, _) = http_get(&format!("http://{admin}/readyz")).await.ok()?;
        (s == 200).then_some(())
    })
    .await;
    let took = started.elapsed();
    eprintln!("ready after {took:?}");
    assert!(took < Duration::from_secs(8), "start took {took:?}");
    running.stop().await.unwrap();
}

/// FINDING (medium): a peer's departed cluster may list the address of a LIVE proxy of
/// this replica's source (here a new worker of the serving cluster, not probed yet).
/// `Departed::addresses()` is then taken to mean "never awaiting a first probe", so the
/// new live proxy skips the withhold-until-first-probe gate: it is published to Envoy at
/// once as UNKNOWN (which Envoy load-balances to) and counted routable, before any probe
/// said it serves. A peer's word opens the first-probe gate for new traffic.
///
/// Safe: `adopt` leaves out any adopted proxy whose address a cluster of the source
/// model (any RayService) lists; and the withholding exemption applies only to endpoints
/// of departed clusters, never to the same address in a live cluster.
#[test]
fn a_peer_departed_cluster_cannot_unwithhold_a_live_unprobed_proxy() {
    use ray_xds::live::health::EndpointHealth;
    use ray_xds::pipeline::{Inputs, Pipeline};
    let new_worker = SocketAddr::from(([10, 0, 0, 5], 8000));
    let one = Arc::new(model("a", None, Default::default()));
    let mut grown = one.services()[0].clone();
    grown.clusters[0].proxies.push(Proxy {
        address: new_worker,
        node_type: MNodeType::Worker,
        ..proxy([10, 0, 0, 5])
    });
    let grown = Arc::new(Model::new(vec![grown]).unwrap());
    let probes = probes(ProbeState::Healthy);
    let dashboards = DashboardStates::default();
    let run = |with_peer: bool| {
        let mut p = Pipeline::new(Default::default(), Default::default());
        let now = at(0);
        p.build(
            &Inputs {
                model: &one,
                probes: &probes,
                dashboards: &dashboards,
                envoys: &(),
            },
            now,
        );
        if with_peer {
            p.set_peers(Arc::new(PeerStates {
                departed: vec![departed(
                    SVC,
                    "ghost",
                    now + Duration::from_secs(20),
                    &[[10, 0, 0, 5]],
                )],
                polled: true,
                ..Default::default()
            }));
        }
        let out = p.build(
            &Inputs {
                model: &grown,
                probes: &probes,
                dashboards: &dashboards,
                envoys: &(),
            },
            now + Duration::from_millis(100),
        );
        out.health.health("default/s/a", new_worker)
    };
    assert_eq!(
        run(false),
        EndpointHealth::Withheld,
        "alone: withheld until probed"
    );
    assert_eq!(
        run(true),
        EndpointHealth::Withheld,
        "a peer's departed cluster naming the address must not publish the unprobed live proxy"
    );
}
