//! Replays the fuzzers' corpus on the stable toolchain: every file of
//! `fuzz/corpus/<target>/` and `fuzz/regressions/<target>/` goes through the same body the
//! cargo-fuzz target runs (`fuzz/bodies.rs`), so every input a fuzzer found
//! interesting, and every crash it found, stays a test. A target whose corpus is missing
//! or empty fails. How to fuzz: `tests/README.md`, "Fuzzing".
//!
//! The seeds made from the project's fixtures are written by
//! `cargo test --test xds -- --ignored fuzz_corpus::write_seeds`.

// A test is a scenario read top to bottom: its steps stay in one function.
#![allow(clippy::too_many_lines)]

#[path = "../../fuzz/bodies.rs"]
mod fuzz_bodies;

use std::path::{Path, PathBuf};

use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use fuzz_bodies::{delta_request, sotw_request, xds_input, XdsOp, TARGETS};
use prost::Message;
use ray_xds::xds::ResourceType;

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz")
}

/// The files of `dir`, sorted; none when it does not exist.
fn files(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = entries
        .map(|e| e.expect("reading a corpus folder").path())
        .filter(|p| p.is_file())
        .collect();
    out.sort();
    out
}

fn replay(target: &str) {
    let body = TARGETS
        .iter()
        .find(|(name, _)| *name == target)
        .map(|(_, body)| *body)
        .expect("a target of fuzz_bodies");
    let corpus = files(&fuzz_dir().join("corpus").join(target));
    assert!(
        !corpus.is_empty(),
        "fuzz/corpus/{target}/ is missing or empty: every target replays a corpus"
    );
    let regressions = files(&fuzz_dir().join("regressions").join(target));
    for file in corpus.iter().chain(&regressions) {
        let data = std::fs::read(file).expect("reading a corpus file");
        if let Err(panic) = std::panic::catch_unwind(|| body(&data)) {
            let why = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            panic!("{target}: {} fails: {why}", file.display());
        }
    }
}

#[test]
fn services_yaml() {
    replay("services_yaml");
}

#[test]
fn config_yaml() {
    replay("config_yaml");
}

#[test]
fn dashboard_json() {
    replay("dashboard_json");
}

#[test]
fn routes() {
    replay("routes");
}

#[test]
fn kubernetes_objects() {
    replay("kubernetes_objects");
}

#[test]
fn xds_requests() {
    replay("xds_requests");
}

/// Every body has a cargo-fuzz target of its name and a test above, and every target a
/// body: `fuzz/Cargo.toml` and `fuzz_targets/` stay in step with `fuzz_bodies`.
#[test]
fn every_target_has_a_fuzzer_and_a_corpus() {
    let manifest = std::fs::read_to_string(fuzz_dir().join("Cargo.toml")).unwrap();
    let this = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/xds/fuzz_corpus.rs"),
    )
    .unwrap();
    let mut names: Vec<&str> = TARGETS.iter().map(|(name, _)| *name).collect();
    names.sort();
    let mut fuzzers: Vec<String> = files(&fuzz_dir().join("fuzz_targets"))
        .iter()
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    fuzzers.sort();
    assert_eq!(
        fuzzers, names,
        "fuzz/fuzz_targets/ and fuzz_bodies::TARGETS differ"
    );
    for name in names {
        assert!(
            manifest.contains(&format!("name = \"{name}\"")),
            "fuzz/Cargo.toml has no [[bin]] {name}"
        );
        assert!(
            this.contains(&format!("replay(\"{name}\")")),
            "no replay test for {name}"
        );
        let target =
            std::fs::read_to_string(fuzz_dir().join(format!("fuzz_targets/{name}.rs"))).unwrap();
        assert!(
            target.contains(&format!("fuzz_bodies::{name}(")),
            "fuzz_targets/{name}.rs does not run fuzz_bodies::{name}"
        );
    }
}

// ---- seeds ----

/// Writes the seed corpus made from the project's own fixtures (`seed-*` files; the
/// fuzzers add the rest), and the fuzzers' dictionaries (`fuzz/dict/`: the keys and
/// values the parsers look for, which a fuzzer built without a sanitizer cannot learn
/// from string comparisons). Run it again after a fixture or a setting changes, then
/// minimize (see tests/README.md).
#[test]
#[ignore = "writes fuzz/corpus/*/seed-* and fuzz/dict/; run by hand"]
fn write_seeds() {
    write_dictionaries();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let read = |p: &str| std::fs::read(root.join(p)).unwrap();
    let write = |target: &str, name: &str, data: &[u8]| {
        let dir = fuzz_dir().join("corpus").join(target);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(format!("seed-{name}")), data).unwrap();
    };
    let readme = String::from_utf8(read("docs/configuration.md")).unwrap();

    // services.yaml: the example, the golden input, the documented shape.
    write("services_yaml", "example", &read("examples/services.yaml"));
    write(
        "services_yaml",
        "two-services",
        &read("tests/golden/two-services.yaml"),
    );
    write(
        "services_yaml",
        "readme",
        yaml_block(&readme, "rayservices:").as_bytes(),
    );
    write(
        "services_yaml",
        "upgrading",
        fuzz_bodies::SERVICES_A.as_bytes(),
    );
    write(
        "services_yaml",
        "upgraded",
        fuzz_bodies::SERVICES_B.as_bytes(),
    );

    // ray-xds.yaml: the example, the documented every field, the Kubernetes ConfigMap's.
    write("config_yaml", "example", &read("examples/ray-xds.yaml"));
    write(
        "config_yaml",
        "readme",
        yaml_block(
            &readme,
            "xds:   { listen: 127.0.0.1:18000, max_message_bytes",
        )
        .as_bytes(),
    );
    let configmap: serde_yaml::Value =
        serde_yaml::from_slice(&read("deploy/ray-xds-config.yaml")).unwrap();
    write(
        "config_yaml",
        "deploy",
        configmap["data"]["ray-xds.yaml"]
            .as_str()
            .unwrap()
            .as_bytes(),
    );

    // The dashboard: every Ray 2.60 capture.
    for name in [
        "01-no-serve",
        "02-running",
        "03-deploying",
        "04-mixed-settled",
        "05-unhealthy",
    ] {
        write(
            "dashboard_json",
            name,
            &read(&format!("tests/fixtures/ray-serve-2.60/{name}.json")),
        );
    }

    // /-/routes: the capture's body (after its headers), and a proxy with no route.
    let captured = read("tests/fixtures/ray-serve-2.60/02-routes.txt");
    let text = String::from_utf8(captured).unwrap();
    let body = text.split("\r\n\r\n").nth(1).or(text.split("\n\n").nth(1));
    write("routes", "ray-2.60", body.unwrap().as_bytes());
    write("routes", "none", b"{}");
    write("routes", "two", br#"{"/hello":"hello","/":"root"}"#);

    // Kubernetes: each KubeRay 1.7 sample as the API server would give it, with the
    // status KubeRay writes, and the pods of its clusters; and annotations.
    let mut all = Vec::new();
    for (i, sample) in [
        "ray-service.sample",
        "ray-service.high-availability",
        "ray-service.incremental-upgrade",
    ]
    .iter()
    .enumerate()
    {
        let text = read(&format!("tests/fixtures/kuberay-1.7/{sample}.yaml"));
        let mut rs: serde_json::Value = serde_yaml::Deserializer::from_slice(&text)
            .map(|doc| serde::Deserialize::deserialize(doc).unwrap())
            .find(|doc: &serde_json::Value| doc["kind"] == "RayService")
            .unwrap();
        let name = rs["metadata"]["name"].as_str().unwrap().to_string();
        rs["metadata"]["namespace"] = "ml".into();
        let active = format!("{name}-raycluster-abcde");
        let pending = format!("{name}-raycluster-fghij");
        rs["status"] = serde_json::json!({
            "activeServiceStatus": {
                "rayClusterName": active,
                "applicationStatuses": {"app": {"status": "RUNNING"}},
            },
            "pendingServiceStatus": {"rayClusterName": pending},
        });
        if i == 1 {
            rs["metadata"]["annotations"] = serde_json::json!({
                "ray-xds.io/hosts": "fruit.example.com, *.fruit.example.com",
                "ray-xds.io/head-proxy": "exclude",
                "ray-xds.io/retries": "5",
                "ray-xds.io/switchover-mode": "progressive",
                "ray-xds.io/switchover-steps": "10,50,100",
            });
        }
        let pod = |cluster: &str, n: u8, head: bool, terminating: bool| {
            let mut p = serde_json::json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": format!("{cluster}-{n}"), "namespace": "ml",
                    "labels": {"ray.io/cluster": cluster,
                               "ray.io/node-type": if head { "head" } else { "worker" }}},
                "spec": {"containers": [{"name": "ray", "image": "rayproject/ray:2.60.0",
                    "ports": [{"containerPort": 8265, "name": "dashboard"},
                              {"containerPort": 8000, "name": "serve"}]}]},
                "status": {"phase": "Running", "podIP": format!("10.1.{i}.{n}")}
            });
            if terminating {
                p["metadata"]["deletionTimestamp"] = "2026-11-29T10:00:00Z".into();
            }
            p
        };
        let items = vec![
            rs,
            pod(&active, 1, true, false),
            pod(&active, 2, false, false),
            pod(&active, 3, false, true),
            pod(&pending, 4, true, false),
        ];
        let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": items});
        write(
            "kubernetes_objects",
            sample,
            serde_json::to_string_pretty(&list).unwrap().as_bytes(),
        );
        all.extend(items);
    }
    write(
        "kubernetes_objects",
        "all",
        serde_json::to_string(&all).unwrap().as_bytes(),
    );
    let mut annotations = String::new();
    for name in ray_xds::source::kubernetes::annotations::documented() {
        let field = ray_xds::policy::all_fields().find(|f| f.annotation == Some(name.as_str()));
        let value = match (name.as_str(), field) {
            ("hosts", _) => "a.example.com,*.b.example.com".to_string(),
            ("head-proxy", _) => "fallback".to_string(),
            (_, Some(f)) => (f.default)(),
            _ => String::new(),
        };
        annotations.push_str(&format!("{name}={value}\n"));
    }
    write("kubernetes_objects", "annotations", annotations.as_bytes());

    // xDS: Envoy's first requests, ACKs and NACKs, a reconnect, an upgrade.
    let snap = &fuzz_bodies::xds_snapshots()[0];
    let eds: Vec<String> = snap
        .resources(ResourceType::Endpoints)
        .keys()
        .map(|k| k.to_string())
        .collect();
    let eds: Vec<&str> = eds.iter().map(String::as_str).collect();
    let rds = ["ray-serve-http"];
    let (c, e, l, r) = (0u8, 1u8, 2u8, 3u8);
    use XdsOp::*;
    let sotw = |ty, names: &[&str], node| sotw_request(ty, names, node, None);
    let sync = vec![
        (Request, 0, sotw(ResourceType::Cluster, &[], true)),
        (Request, 0, sotw(ResourceType::Listener, &[], false)),
        (Answer, c, sotw(ResourceType::Cluster, &[], false)),
        (Request, 0, sotw(ResourceType::Endpoints, &eds, false)),
        (Answer, e, sotw(ResourceType::Endpoints, &eds, false)),
        (Answer, l, sotw(ResourceType::Listener, &[], false)),
        (Request, 0, sotw(ResourceType::Route, &rds, false)),
        (Answer, r, sotw(ResourceType::Route, &rds, false)),
        (Inspect, 0, vec![]),
        (Snapshot, 1, vec![]),
        (Answer, c, sotw(ResourceType::Cluster, &[], false)),
        (Answer, e, sotw(ResourceType::Endpoints, &eds, false)),
        (Answer, r, sotw(ResourceType::Route, &rds, false)),
        (
            Answer,
            c,
            sotw_request(ResourceType::Cluster, &[], false, Some("ml/x: bad cluster")),
        ),
        (Snapshot, 2, vec![]),
        (Answer, l, sotw(ResourceType::Listener, &[], false)),
        (Answer, e, sotw(ResourceType::Endpoints, &[], false)),
        (Inspect, 0, vec![]),
    ];
    write("xds_requests", "sotw-sync", &xds_input(false, &sync));
    let reconnect = vec![
        (
            Request,
            0,
            sotw_versioned(ResourceType::Cluster, &[], "stale-version"),
        ),
        (
            Request,
            0,
            sotw_versioned(ResourceType::Route, &rds, "stale-version"),
        ),
        (Settle, 0, vec![]),
        (Answer, c, sotw(ResourceType::Cluster, &[], false)),
        (Request, 0, sotw(ResourceType::Endpoints, &eds, false)),
        (Answer, e, sotw(ResourceType::Endpoints, &eds, false)),
        (Request, 0, sotw(ResourceType::Endpoints, &[], false)),
    ];
    write(
        "xds_requests",
        "sotw-reconnect",
        &xds_input(false, &reconnect),
    );

    let delta = |ty, subscribe: &[&str]| delta_request(ty, subscribe, &[], &[], false, None);
    let sync = vec![
        (
            Request,
            0,
            delta_request(ResourceType::Cluster, &[], &[], &[], true, None),
        ),
        (Request, 0, delta(ResourceType::Listener, &[])),
        (Answer, c, delta(ResourceType::Cluster, &[])),
        (Request, 0, delta(ResourceType::Endpoints, &eds)),
        (Answer, e, delta(ResourceType::Endpoints, &[])),
        (Answer, l, delta(ResourceType::Listener, &[])),
        (Request, 0, delta(ResourceType::Route, &rds)),
        (Answer, r, delta(ResourceType::Route, &[])),
        (Snapshot, 1, vec![]),
        (Answer, c, delta(ResourceType::Cluster, &[])),
        (
            Answer,
            e,
            delta_request(ResourceType::Endpoints, &[], &eds[..1], &[], false, None),
        ),
        (
            Answer,
            c,
            delta_request(ResourceType::Cluster, &["*"], &[], &[], false, Some("bad")),
        ),
        (Snapshot, 2, vec![]),
        (Answer, c, delta(ResourceType::Cluster, &[])),
        (Inspect, 0, vec![]),
    ];
    write("xds_requests", "delta-sync", &xds_input(true, &sync));
    let held: Vec<(&str, &str)> = eds.iter().map(|n| (*n, "v0")).collect();
    let reconnect = vec![
        (
            Request,
            0,
            delta_request(ResourceType::Cluster, &[], &[], &held, true, None),
        ),
        (
            Request,
            0,
            delta_request(
                ResourceType::Route,
                &rds,
                &[],
                &[("ray-serve-http", "v0")],
                false,
                None,
            ),
        ),
        (Settle, 0, vec![]),
        (Answer, c, delta(ResourceType::Cluster, &[])),
        (
            Request,
            0,
            delta(ResourceType::Endpoints, &["no-such-cluster"]),
        ),
    ];
    write(
        "xds_requests",
        "delta-reconnect",
        &xds_input(true, &reconnect),
    );
    write(
        "xds_requests",
        "unknown-type",
        &xds_input(
            false,
            &[(
                Request,
                0,
                sotw_typed("type.googleapis.com/envoy.config.secret"),
            )],
        ),
    );
}

fn write_dictionaries() {
    use ray_xds::policy::all_fields;
    let dir = fuzz_dir().join("dict");
    std::fs::create_dir_all(&dir).unwrap();
    let write = |target: &str, words: Vec<String>| {
        let mut words: Vec<String> = words
            .into_iter()
            .map(|w| format!("\"{}\"\n", dict_escape(&w)))
            .collect();
        words.sort();
        words.dedup();
        std::fs::write(dir.join(format!("{target}.dict")), words.concat()).unwrap();
    };
    let strings = |words: &[&str]| words.iter().map(|w| w.to_string()).collect::<Vec<_>>();
    // Every setting: its section, key, default and bounds, as YAML writes them.
    let mut policy: Vec<String> = all_fields()
        .flat_map(|f| [f.section.to_string(), f.name.to_string(), (f.default)()])
        .collect();
    policy.extend(all_fields().flat_map(|f| {
        (f.range)()
            .split("..=")
            .map(str::to_string)
            .collect::<Vec<_>>()
    }));
    policy.extend(strings(&[
        ": ",
        "{ ",
        " }",
        "[",
        "]",
        "\n  ",
        "\n- ",
        "~",
        "null",
        "true",
        "ms",
        "s",
        "m",
        "h",
        "1day",
        "18446744073709551615",
        "-1",
        "0s",
        "atomic",
        "progressive",
    ]));
    let mut services = policy.clone();
    services.extend(strings(&[
        "rayservices",
        "name",
        "namespace",
        "hosts",
        "active_cluster",
        "pending_cluster",
        "clusters",
        "dashboard",
        "proxies",
        "address",
        "node_type",
        "head",
        "worker",
        "draining",
        "head_proxy",
        "exclude",
        "include",
        "fallback",
        "probe",
        "traffic",
        "switchover",
        "127.0.0.1:8000",
        "[::1]:8000",
        "169.254.169.254:80",
        "*",
        "http://10.0.0.5:8265",
    ]));
    write("services_yaml", services);
    let mut config = policy;
    config.extend(strings(&[
        "xds",
        "listen",
        "max_message_bytes",
        "max_connections_per_peer",
        "max_streams",
        "admin",
        "gateway",
        "http_listener",
        "address",
        "port",
        "upstream_idle_timeout",
        "connect_timeout",
        "source",
        "file",
        "path",
        "poll_interval",
        "kubernetes",
        "namespaces",
        "rayservice_selector",
        "api_server",
        "proxies",
        "networks",
        "10.0.0.0/8",
        "fd00::/8",
        "0.0.0.0:18000",
        "127.0.0.1:19000",
    ]));
    write("config_yaml", config);
    write(
        "dashboard_json",
        strings(&[
            "applications",
            "proxies",
            "target_groups",
            "targets",
            "protocol",
            "HTTP",
            "gRPC",
            "ip",
            "port",
            "name",
            "node_id",
            "node_ip",
            "actor_name",
            "status",
            "route_prefix",
            "message",
            "controller_info",
            "http_options",
            "target_capacity",
            "keep_alive_timeout_s",
            "RUNNING",
            "DEPLOYING",
            "DEPLOY_FAILED",
            "UNHEALTHY",
            "DELETING",
            "NOT_STARTED",
            "HEALTHY",
            "STARTING",
            "DRAINING",
            "192.0.2.2",
            "192.0.2.3",
            "::1",
            "null",
            "{}",
            "[]",
        ]),
    );
    write("routes", strings(&["/hello", "\"/\"", "{}", "null"]));
    let mut kubernetes: Vec<String> = ray_xds::source::kubernetes::annotations::documented()
        .into_iter()
        .flat_map(|a| [format!("ray-xds.io/{a}"), format!("{a}=")])
        .collect();
    kubernetes.extend(all_fields().map(|f| (f.default)()));
    kubernetes.extend(strings(&[
        "apiVersion",
        "kind",
        "Pod",
        "RayService",
        "List",
        "items",
        "metadata",
        "name",
        "namespace",
        "annotations",
        "labels",
        "ray.io/cluster",
        "ray.io/node-type",
        "head",
        "worker",
        "deletionTimestamp",
        "spec",
        "excludeHeadPodFromServeSvc",
        "containers",
        "ports",
        "containerPort",
        "serve",
        "dashboard",
        "status",
        "phase",
        "Running",
        "podIP",
        "activeServiceStatus",
        "pendingServiceStatus",
        "rayClusterName",
        "applicationStatuses",
        "exclude",
        "include",
        "fallback",
        "10.1.0.1",
        "null",
    ]));
    write("kubernetes_objects", kubernetes);
    write(
        "xds_requests",
        ResourceType::ALL
            .iter()
            .map(|t| t.type_url().to_string())
            .chain(strings(&["ray-serve-http", "ml/text-ml/text-ml-a", "*"]))
            .collect(),
    );
}

/// A word as a libFuzzer dictionary writes it: `\\`, `\"` and `\xNN` escapes.
fn dict_escape(word: &str) -> String {
    word.bytes()
        .map(|b| match b {
            b'\\' => "\\\\".to_string(),
            b'"' => "\\\"".to_string(),
            b' '..=b'~' => char::from(b).to_string(),
            _ => format!("\\x{b:02X}"),
        })
        .collect()
}

/// A state-of-the-world request reporting a version held from an earlier stream.
fn sotw_versioned(ty: ResourceType, names: &[&str], version: &str) -> Vec<u8> {
    DiscoveryRequest {
        type_url: ty.type_url().into(),
        resource_names: names.iter().map(|n| n.to_string()).collect(),
        version_info: version.into(),
        ..Default::default()
    }
    .encode_to_vec()
}

/// A state-of-the-world request for a type ray-xds does not serve.
fn sotw_typed(type_url: &str) -> Vec<u8> {
    DiscoveryRequest {
        type_url: type_url.into(),
        ..Default::default()
    }
    .encode_to_vec()
}

/// The ```yaml block of `markdown` whose text starts with `start`.
fn yaml_block(markdown: &str, start: &str) -> String {
    markdown
        .split("```yaml\n")
        .skip(1)
        .filter_map(|b| b.split("```").next())
        .find(|b| b.starts_with(start))
        .unwrap_or_else(|| panic!("docs/configuration.md has no yaml block starting {start:?}"))
        .to_string()
}
