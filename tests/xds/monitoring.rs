//! `deploy/monitoring/`: the alert rules checked and unit-tested by promtool; every metric
//! the rules and the dashboard read is one ray-xds exports, with the ending its kind
//! gives; the dashboard's JSON well formed (no Grafana server can be installed here); and
//! a real Prometheus scraping a real ray-xds every second, the rules' `for:` shortened:
//! nothing fires while all is well, then exactly the alerts of two real faults fire (an
//! Envoy's NACK, a cluster whose every proxy hangs).
//!
//! promtool and prometheus are Debian's `prometheus` package, which `scripts/test.sh`
//! installs.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use ray_serve_sim::{NodeType, ProxyMode};
use serde_json::Value;
use support::*;

const DEADLINE: Duration = Duration::from_secs(60);

fn monitoring_dir() -> PathBuf {
    project_root().join("deploy/monitoring")
}

/// A tool of Debian's `prometheus` package.
fn tool(name: &str) -> Command {
    let found = Command::new("which")
        .arg(name)
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found,
        "{name} is not installed: scripts/test.sh installs Debian's `prometheus` package"
    );
    Command::new(name)
}

fn rules() -> serde_yaml::Value {
    serde_yaml::from_str(&std::fs::read_to_string(monitoring_dir().join("alerts.yaml")).unwrap())
        .unwrap()
}

/// (alert name, expression) of every rule.
fn alerts() -> Vec<(String, String)> {
    let rules = rules();
    rules["groups"]
        .as_sequence()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_sequence().unwrap().iter())
        .map(|r| {
            (
                r["alert"].as_str().unwrap().to_string(),
                r["expr"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn dashboard() -> Value {
    serde_json::from_str(
        &std::fs::read_to_string(monitoring_dir().join("grafana-dashboard.json")).unwrap(),
    )
    .unwrap()
}

/// Every query of the dashboard: its panels' targets and its variables'.
fn dashboard_queries(d: &Value) -> Vec<String> {
    let mut out: Vec<String> = d["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap().iter())
        .map(|t| t["expr"].as_str().unwrap().to_string())
        .collect();
    for v in d["templating"]["list"].as_array().unwrap() {
        if let Some(q) = v["query"]["query"].as_str() {
            out.push(q.to_string());
        }
    }
    out
}

/// The `ray_xds_*` names an expression reads.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = expr;
    while let Some(at) = rest.find("ray_xds_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        out.insert(tail[..end].to_string());
        rest = &tail[end..];
    }
    out
}

#[test]
fn promtool_checks_and_unit_tests_the_alert_rules() {
    for args in [
        ["check", "rules", "alerts.yaml"],
        ["test", "rules", "alerts.test.yaml"],
    ] {
        let out = tool("promtool")
            .args(args)
            .current_dir(monitoring_dir())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "promtool {args:?}:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // Every alert has a test that makes it fire.
    let tests = std::fs::read_to_string(monitoring_dir().join("alerts.test.yaml")).unwrap();
    for (alert, _) in alerts() {
        assert!(
            tests.contains(&format!(
                "alertname: {alert}\n        exp_alerts:\n          - "
            )),
            "no test fires {alert}"
        );
    }
}

/// The dashboard as Grafana reads it: unique panel ids on a 24-column grid, every target
/// with a query and its own refId, on the `datasource` variable, scoped to the job, and
/// the variables it names defined.
#[test]
fn the_dashboard_is_well_formed() {
    let d = dashboard();
    assert_eq!(d["uid"], "ray-xds");
    let vars: BTreeSet<&str> = d["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert_eq!(vars, BTreeSet::from(["datasource", "instance"]));
    let mut ids = BTreeSet::new();
    for p in d["panels"].as_array().unwrap() {
        assert!(ids.insert(p["id"].as_u64().unwrap()), "duplicate id: {p}");
        let grid = &p["gridPos"];
        let (x, w) = (grid["x"].as_u64().unwrap(), grid["w"].as_u64().unwrap());
        assert!(x + w <= 24 && grid["h"].as_u64().unwrap() > 0, "{p}");
        assert_eq!(p["datasource"]["uid"], "${datasource}", "{p}");
        let mut refs = BTreeSet::new();
        for t in p["targets"].as_array().unwrap() {
            assert!(refs.insert(t["refId"].as_str().unwrap()), "{p}");
            let expr = t["expr"].as_str().unwrap();
            assert!(expr.contains("job=\"ray-xds\""), "{expr}");
            if expr.contains("ray_xds_") {
                assert!(expr.contains("instance=~\"$instance\""), "{expr}");
            }
        }
        assert!(!refs.is_empty(), "a panel without a query: {p}");
    }
}

/// The metric names ray-xds's `/metrics` declares (`# TYPE`), with their kinds.
fn exported(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| {
            let (name, kind) = l.split_once(' ')?;
            Some((name.to_string(), kind.to_string()))
        })
        .collect()
}

/// Whether `name`, as a query reads it, is a series of an exported metric: a gauge as
/// named, a counter with `_total`, a histogram's `_bucket`, `_count` or `_sum`.
fn reads_an_exported_series(exported: &BTreeMap<String, String>, name: &str) -> bool {
    let kind = |n: &str| exported.get(n).map(String::as_str);
    if matches!(kind(name), Some("gauge" | "unknown")) {
        return true;
    }
    if let Some(base) = name.strip_suffix("_total") {
        if kind(base) == Some("counter") {
            return true;
        }
    }
    ["_bucket", "_count", "_sum"].iter().any(|end| {
        name.strip_suffix(end)
            .is_some_and(|base| kind(base) == Some("histogram"))
    })
}

/// A metric family shows in `/metrics` from its first series on, so the events that make
/// them happen first: an Envoy carrying traffic (streams, pushes, ACKs, load reports), a
/// stream asking for a type that does not exist (a stream error), an edit and a bad edit
/// of the services file, a RayService whose dashboard does not answer. Then every name a
/// rule or a panel reads must be exported, with the ending its kind gives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_rules_and_the_dashboard_read_is_one_ray_xds_exports() {
    let cluster = SimCluster::start("demo-a", &[NodeType::Head, NodeType::Worker]).await;
    let dir = tempfile::tempdir().unwrap();
    let services = dir.path().join("services.yaml");
    let silent_dashboard = free_port();
    let text = |extra: &str| {
        format!(
            "{}{extra}  - name: silent\n    namespace: default\n    hosts: [\"silent.example\"]\n    active_cluster: s\n    clusters:\n      - name: s\n        dashboard: http://127.0.0.1:{silent_dashboard}\n",
            services_yaml("demo-a", &[&cluster])
        )
    };
    std::fs::write(&services, text("")).unwrap();
    let config = test_config(&services, free_port());
    let running = ray_xds::runtime::start(config, Default::default())
        .await
        .unwrap();
    let (_envoy, port) = envoy_carrying_traffic(running.xds_addr.port(), Bootstrap::Sotw).await;
    for _ in 0..5 {
        through_envoy(port).await;
    }
    let (tx, _rx) = support::ads::sotw_stream(running.xds_addr).await;
    tx.send(
        envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest {
            node: support::ads::node("monitoring-bogus"),
            type_url: "type.googleapis.com/not.a.Type".into(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    write_atomic(&services, "rayservices: [ this is not a services file");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    write_atomic(&services, &text("    head_proxy: include\n"));

    let mut read = BTreeSet::new();
    for (_, expr) in alerts() {
        read.extend(metric_names(&expr));
    }
    for expr in dashboard_queries(&dashboard()) {
        read.extend(metric_names(&expr));
    }
    assert!(read.len() > 15, "{read:?}");
    let admin = running.admin_addr;
    let missing = || async {
        let exported = exported(&admin_get(admin, "/metrics").await);
        read.iter()
            .filter(|n| !reads_an_exported_series(&exported, n))
            .cloned()
            .collect::<Vec<String>>()
    };
    let waited = tokio::time::Instant::now();
    let mut left = missing().await;
    while !left.is_empty() && waited.elapsed() < DEADLINE {
        tokio::time::sleep(Duration::from_millis(500)).await;
        left = missing().await;
    }
    assert!(left.is_empty(), "read but not exported: {left:?}");
    // The counters the alerts take increase() of exist before their first event.
    let text = admin_get(admin, "/metrics").await;
    for series in [
        "ray_xds_xds_nacks_total{protocol=\"sotw\",type=\"cds\"} 0",
        "ray_xds_xds_nacks_total{protocol=\"delta\",type=\"rds\"} 0",
        "ray_xds_prestop_calls_total{result=\"grace\"} 0",
        "ray_xds_switchover_transitions_total{state=\"rolled_back\"} 0",
        "ray_xds_source_synced 1",
    ] {
        assert!(text.contains(series), "{series} not in\n{text}");
    }
    assert!(
        text.lines().any(
            |l| l.starts_with("ray_xds_component_restarts_total{component=") && l.ends_with(" 0")
        ),
        "{text}"
    );
    running.stop().await.unwrap();
}

/// The alert rules with every `for:` at 1 s, for a test that cannot wait minutes.
fn rules_with_short_for(dir: &Path) -> PathBuf {
    let text = std::fs::read_to_string(monitoring_dir().join("alerts.yaml")).unwrap();
    let short: String = text
        .lines()
        .map(|l| match l.trim_start().strip_prefix("for: ") {
            Some(_) => format!("{}for: 1s", &l[..l.len() - l.trim_start().len()]),
            None => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n");
    assert_ne!(short, text);
    let path = dir.join("alerts.yaml");
    std::fs::write(&path, short).unwrap();
    path
}

/// Prometheus's alerts now: name → state (`pending` or `firing`).
async fn prometheus_alerts(port: u16) -> Option<BTreeMap<String, String>> {
    let (status, body) = http_get(&format!("http://127.0.0.1:{port}/api/v1/alerts"))
        .await
        .ok()?;
    if status != 200 {
        return None;
    }
    let v: Value = serde_json::from_str(&body).ok()?;
    Some(
        v["data"]["alerts"]
            .as_array()?
            .iter()
            .map(|a| {
                (
                    a["labels"]["alertname"].as_str().unwrap_or("").to_string(),
                    a["state"].as_str().unwrap_or("").to_string(),
                )
            })
            .collect(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_fires_the_alerts_of_real_faults_and_nothing_else() {
    let cluster = SimCluster::start("demo-a", &[NodeType::Head, NodeType::Worker]).await;
    let dir = tempfile::tempdir().unwrap();
    let services = dir.path().join("services.yaml");
    std::fs::write(&services, services_yaml("demo-a", &[&cluster])).unwrap();
    let config = test_config(&services, free_port());
    let running = ray_xds::runtime::start(config, Default::default())
        .await
        .unwrap();
    let rules = rules_with_short_for(dir.path());
    let prometheus_yml = dir.path().join("prometheus.yml");
    std::fs::write(
        &prometheus_yml,
        format!(
            "global: {{ scrape_interval: 1s, evaluation_interval: 1s }}\nrule_files: [{}]\nscrape_configs:\n  - job_name: ray-xds\n    static_configs: [{{ targets: ['{}'] }}]\n",
            rules.display(),
            running.admin_addr
        ),
    )
    .unwrap();
    let port = free_port();
    let _prometheus = spawn(
        "prometheus",
        tool("prometheus")
            .arg(format!("--config.file={}", prometheus_yml.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("prometheus.log")).unwrap()),
    );
    eventually("Prometheus scrapes ray-xds", DEADLINE, || async {
        let (_, body) = http_get(&format!(
            "http://127.0.0.1:{port}/api/v1/query?query=ray_xds_source_synced"
        ))
        .await
        .ok()?;
        body.contains("\"value\"").then_some(())
    })
    .await;
    // All is well for a while: nothing pending, nothing firing.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let quiet = prometheus_alerts(port).await.unwrap();
    assert!(quiet.is_empty(), "alerts while all is well: {quiet:?}");

    // An Envoy NACKs the clusters; every proxy of the cluster hangs (its probes time out,
    // and the cluster fails open).
    let _nacking = crate::status::answer_clusters(running.xds_addr, "monitoring-nacks", true).await;
    cluster.set_mode(0, ProxyMode::Hang);
    cluster.set_mode(1, ProxyMode::Hang);
    let firing = eventually("both alerts fire", DEADLINE, || async {
        let alerts = prometheus_alerts(port).await?;
        let firing = |name: &str| alerts.get(name).map(String::as_str) == Some("firing");
        (firing("RayXdsEnvoyRejectsConfig") && firing("RayXdsNoRoutableProxy")).then_some(alerts)
    })
    .await;
    assert_eq!(
        firing.keys().map(String::as_str).collect::<Vec<_>>(),
        ["RayXdsEnvoyRejectsConfig", "RayXdsNoRoutableProxy"],
        "{firing:?}"
    );
    running.stop().await.unwrap();
}
