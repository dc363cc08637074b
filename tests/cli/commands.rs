//! The `ray-xds` binary as a user runs it: bad config fails at start with file, line and
//! field; a good one serves the admin endpoints.

use std::process::Command;
use std::time::Duration;

use support::*;

#[test]
fn a_bad_config_fails_at_start_naming_file_line_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("ray-xds.yaml");
    std::fs::write(
        &config,
        "xds:\n  listen: 127.0.0.1:18000\nadmin:\n  lisen: 127.0.0.1:19000\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_ray-xds"))
        .args(["serve", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("ray-xds.yaml: line 4, column 3: field `admin.lisen`"),
        "{stderr}"
    );
    assert!(
        stderr.contains("unknown field `lisen`, expected `listen`"),
        "{stderr}"
    );
}

#[test]
fn a_bad_services_file_fails_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let services = dir.path().join("services.yaml");
    std::fs::write(
        &services,
        "rayservices:\n  - name: demo\n    active_cluster: nope\n    clusters: []\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_ray-xds"))
        .args([
            "serve",
            "--xds-listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--source-file",
        ])
        .arg(&services)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("rayservice default/demo: active_cluster \"nope\""),
        "{stderr}"
    );
}

#[test]
fn help_documents_flags_and_environment() {
    let out = Command::new(env!("CARGO_BIN_EXE_ray-xds"))
        .args(["serve", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(
        help.contains("--xds-listen") && help.contains("RAY_XDS_XDS_LISTEN"),
        "{help}"
    );
}

#[tokio::test]
async fn flags_and_environment_configure_a_running_server() {
    let dir = tempfile::tempdir().unwrap();
    let services = dir.path().join("services.yaml");
    std::fs::write(&services, "rayservices:\n  - name: demo\n    hosts: ['*']\n    active_cluster: a\n    clusters: [ { name: a, proxies: [ { address: 127.0.0.1:8000, node_type: head } ] } ]\n").unwrap();
    let admin_port = free_port();
    let _server = spawn(
        "ray-xds",
        Command::new(env!("CARGO_BIN_EXE_ray-xds"))
            .args(["serve", "--xds-listen", "127.0.0.1:0"])
            .env("RAY_XDS_ADMIN_LISTEN", format!("127.0.0.1:{admin_port}"))
            .env("RAY_XDS_SOURCE_FILE", &services)
            .env("RAY_XDS_GATEWAY_PORT", "10123")
            .stderr(std::process::Stdio::null()),
    );
    let base = format!("http://127.0.0.1:{admin_port}");
    let ready = eventually("ready", Duration::from_secs(20), || async {
        http_get(&format!("{base}/readyz"))
            .await
            .ok()
            .filter(|(s, _)| *s == 200)
    })
    .await;
    assert!(ready.1.starts_with("ready: snapshot "), "{}", ready.1);
    assert_eq!(http_get(&format!("{base}/healthz")).await.unwrap().0, 200);
    let (_, snapshot) = http_get(&format!("{base}/debug/snapshot")).await.unwrap();
    let v: serde_json::Value = serde_json::from_str(&snapshot).unwrap();
    assert_eq!(v["types"]["cds"]["resources"][0]["name"], "default/demo/a");
    assert_eq!(
        v["types"]["rds"]["resources"][0]["cluster_refs"][0],
        "default/demo/a"
    );
    let listener = &v["types"]["lds"]["resources"][0]["resource"];
    assert_eq!(
        listener["address"]["socket_address"]["port_value"], 10123,
        "the gateway port from the environment: {listener}"
    );
    let (_, metrics) = http_get(&format!("{base}/metrics")).await.unwrap();
    assert!(
        metrics.contains("ray_xds_snapshot_info{version="),
        "{metrics}"
    );
    assert_eq!(
        metric(&metrics, "ray_xds_snapshot_resources"),
        4.0,
        "{metrics}"
    );
}

#[test]
fn unusable_xds_tls_files_fail_at_start_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let pki = support::tls::TestPki::new(&dir.path().join("pki"));
    std::fs::write(dir.path().join("services.yaml"), "rayservices: []\n").unwrap();
    // The client's key with the server's certificate: not a pair.
    let out = Command::new(env!("CARGO_BIN_EXE_ray-xds"))
        .args([
            "serve",
            "--xds-listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .arg("--source-file")
        .arg(dir.path().join("services.yaml"))
        .arg("--xds-tls-cert")
        .arg(&pki.server_cert_path)
        .arg("--xds-tls-key")
        .arg(&pki.client_key_path)
        .arg("--xds-tls-client-ca")
        .arg(&pki.ca_pem_path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("xds.tls")
            && stderr.contains("server.crt and")
            && stderr.contains("client.key"),
        "{stderr}"
    );
}

#[tokio::test]
async fn debug_pages_on_a_listener_of_their_own_are_gone_from_the_admin_port() {
    let dir = tempfile::tempdir().unwrap();
    let services = dir.path().join("services.yaml");
    std::fs::write(&services, "rayservices: []\n").unwrap();
    let (admin_port, debug_port) = (free_port(), free_port());
    let _server = spawn(
        "ray-xds",
        Command::new(env!("CARGO_BIN_EXE_ray-xds"))
            .args(["serve", "--xds-listen", "127.0.0.1:0"])
            .args(["--admin-listen", &format!("127.0.0.1:{admin_port}")])
            .env(
                "RAY_XDS_ADMIN_DEBUG_LISTEN",
                format!("127.0.0.1:{debug_port}"),
            )
            .env("RAY_XDS_SOURCE_FILE", &services)
            .stderr(std::process::Stdio::null()),
    );
    let admin = format!("http://127.0.0.1:{admin_port}");
    let debug = format!("http://127.0.0.1:{debug_port}");
    eventually("ready", Duration::from_secs(20), || async {
        http_get(&format!("{admin}/readyz"))
            .await
            .ok()
            .filter(|(s, _)| *s == 200)
    })
    .await;
    for page in ["/debug/state", "/debug/clients", "/debug/snapshot"] {
        assert_eq!(
            http_get(&format!("{admin}{page}")).await.unwrap().0,
            404,
            "{page}"
        );
        assert_eq!(
            http_get(&format!("{debug}{page}")).await.unwrap().0,
            200,
            "{page}"
        );
    }
    assert_eq!(http_get(&format!("{admin}/metrics")).await.unwrap().0, 200);
    assert_eq!(http_get(&format!("{debug}/healthz")).await.unwrap().0, 200);
    assert_eq!(http_get(&format!("{debug}/metrics")).await.unwrap().0, 404);
}
