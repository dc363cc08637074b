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

/// Runs the binary with `args`: (exit code, stdout, stderr).
fn run(args: &[&std::ffi::OsStr]) -> (Option<i32>, String, String) {
    outcome(Command::new(env!("CARGO_BIN_EXE_ray-xds")).args(args))
}

fn outcome(command: &mut Command) -> (Option<i32>, String, String) {
    let out = command.output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn check_reads_what_the_config_names_and_summarizes_it() {
    let dir = tempfile::tempdir().unwrap();
    let pki = support::tls::TestPki::new(&dir.path().join("pki"));
    std::fs::copy(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/two-services.yaml"),
        dir.path().join("services.yaml"),
    )
    .unwrap();
    let config = dir.path().join("ray-xds.yaml");
    std::fs::write(
        &config,
        format!(
            "xds:\n  listen: 127.0.0.1:18000\n  tls:\n    cert: {}\n    key: {}\n    client_ca: {}\n\
             admin:\n  listen: 127.0.0.1:19000\n  debug_listen: 127.0.0.1:19001\n\
             source:\n  file:\n    path: services.yaml\n",
            pki.server_cert_path.display(),
            pki.server_key_path.display(),
            pki.ca_pem_path.display()
        ),
    )
    .unwrap();
    let (code, stdout, stderr) = run(&["check".as_ref(), "--config".as_ref(), config.as_ref()]);
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    for line in [
        "xds: 127.0.0.1:18000 (mTLS (certificate, key and client CA read))",
        "admin: 127.0.0.1:19000 (/debug/* on 127.0.0.1:19001)",
        "2 RayService(s), 3 cluster(s), 4 listed proxy(ies)",
        "  ml/text-ml: active text-ml-abc12, pending text-ml-def34",
        "  default/demo: active demo-a",
    ] {
        assert!(stdout.contains(line), "{line:?} not in:\n{stdout}");
    }
    assert!(stdout.ends_with("ok\n"), "{stdout}");
    // A flag overrides the file, as for `serve`.
    let (code, stdout, _) = run(&[
        "check".as_ref(),
        "--config".as_ref(),
        config.as_ref(),
        "--xds-listen".as_ref(),
        "127.0.0.1:18500".as_ref(),
    ]);
    assert_eq!(code, Some(0));
    assert!(stdout.contains("xds: 127.0.0.1:18500"), "{stdout}");
}

/// Each refusal of `check` is `serve`'s own, word for word, with exit status 1 (serve's
/// is 2 for a config error, or 1 for what fails later at start).
#[test]
fn check_refuses_what_serve_refuses_with_the_same_words() {
    let dir = tempfile::tempdir().unwrap();
    let pki = support::tls::TestPki::new(&dir.path().join("pki"));
    let good_services = dir.path().join("services.yaml");
    std::fs::write(&good_services, "rayservices: []\n").unwrap();
    let bad_services = dir.path().join("bad-services.yaml");
    std::fs::write(
        &bad_services,
        "rayservices:\n  - name: demo\n    active_cluster: nope\n    clusters: []\n",
    )
    .unwrap();
    let typo = dir.path().join("typo.yaml");
    std::fs::write(
        &typo,
        "xds:\n  listen: 127.0.0.1:18000\nadmin:\n  lisen: 127.0.0.1:19000\n",
    )
    .unwrap();
    let out_of_range = dir.path().join("range.yaml");
    std::fs::write(&out_of_range, "dashboard:\n  misses_tolerated: 11\n").unwrap();
    let listen = [
        "--xds-listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
    ];
    let with_listen = |rest: Vec<&std::ffi::OsStr>| -> Vec<std::ffi::OsString> {
        listen
            .iter()
            .map(|s| s.into())
            .chain(rest.into_iter().map(|s| s.to_os_string()))
            .collect()
    };
    let cases: Vec<(&str, Vec<std::ffi::OsString>, &str)> = vec![
        (
            "a misspelled field",
            vec!["--config".into(), typo.clone().into()],
            "typo.yaml: line 4, column 3: field `admin.lisen`",
        ),
        (
            "a value out of range",
            with_listen(vec![
                "--config".as_ref(),
                out_of_range.as_ref(),
                "--source-file".as_ref(),
                good_services.as_ref(),
            ]),
            "misses_tolerated",
        ),
        (
            "a services file naming a cluster it does not list",
            with_listen(vec!["--source-file".as_ref(), bad_services.as_ref()]),
            "rayservice default/demo: active_cluster \"nope\"",
        ),
        (
            "a missing services file",
            with_listen(vec![
                "--source-file".as_ref(),
                dir.path().join("missing.yaml").as_os_str(),
            ]),
            "missing.yaml: cannot read",
        ),
        (
            "a key that is not the certificate's",
            with_listen(vec![
                "--source-file".as_ref(),
                good_services.as_ref(),
                "--xds-tls-cert".as_ref(),
                pki.server_cert_path.as_ref(),
                "--xds-tls-key".as_ref(),
                pki.client_key_path.as_ref(),
                "--xds-tls-client-ca".as_ref(),
                pki.ca_pem_path.as_ref(),
            ]),
            "client.key",
        ),
    ];
    for (what, args, expected) in cases {
        let check_args: Vec<&std::ffi::OsStr> = std::iter::once("check".as_ref())
            .chain(args.iter().map(|a| a.as_os_str()))
            .collect();
        let (code, stdout, stderr) = run(&check_args);
        assert_eq!(code, Some(1), "{what}: check accepted it:\n{stdout}");
        assert!(stderr.contains(expected), "{what}: {stderr}");
        let message = stderr
            .trim_end()
            .strip_prefix("ray-xds check: ")
            .unwrap_or_else(|| panic!("{what}: {stderr}"));
        let serve_args: Vec<&std::ffi::OsStr> = std::iter::once("serve".as_ref())
            .chain(args.iter().map(|a| a.as_os_str()))
            .collect();
        let (code, _, serve_stderr) = run(&serve_args);
        assert_ne!(code, Some(0), "{what}: serve accepted it");
        assert!(
            serve_stderr.contains(message),
            "{what}: serve said\n{serve_stderr}\ncheck said\n{message}"
        );
    }
}

/// deploy/'s config checks clean offline (its TLS files exist only in the pod), and the
/// same config read where it runs would need them.
#[test]
fn check_offline_takes_deploy_s_config_which_names_files_only_the_pod_has() {
    let manifest = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/ray-xds-config.yaml"),
    )
    .unwrap();
    let config_map: serde_yaml::Value = serde_yaml::from_str(&manifest).unwrap();
    let text = config_map["data"]["ray-xds.yaml"].as_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("ray-xds.yaml");
    std::fs::write(&config, text).unwrap();
    let (code, stdout, stderr) = run(&[
        "check".as_ref(),
        "--offline".as_ref(),
        "--config".as_ref(),
        config.as_ref(),
    ]);
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("source: kubernetes (all namespaces;")
            && stdout.contains("not read, --offline"),
        "{stdout}"
    );
    let (code, _, stderr) = run(&["check".as_ref(), "--config".as_ref(), config.as_ref()]);
    assert_eq!(code, Some(1));
    assert!(stderr.contains("/etc/ray-xds/tls/tls.crt"), "{stderr}");
}

/// Runs the binary with `args` in an environment of `env` only (and `PATH`).
fn run_in(
    env: &[(&str, &std::ffi::OsStr)],
    args: &[&std::ffi::OsStr],
) -> (Option<i32>, String, String) {
    outcome(
        Command::new(env!("CARGO_BIN_EXE_ray-xds"))
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .envs(env.iter().copied())
            .args(args),
    )
}

/// A Kubernetes source's setting for `check`: an empty home, a CA of the test's own (so
/// nothing depends on the machine's trust store) and a config naming the source.
struct KubeCheck {
    dir: tempfile::TempDir,
    home: std::path::PathBuf,
    pki: support::tls::TestPki,
    config: std::path::PathBuf,
}

impl KubeCheck {
    fn new() -> KubeCheck {
        let dir = tempfile::tempdir().unwrap();
        let home = dir.path().join("home");
        std::fs::create_dir(&home).unwrap();
        let pki = support::tls::TestPki::new(&dir.path().join("pki"));
        let config = dir.path().join("ray-xds.yaml");
        std::fs::write(
            &config,
            "xds:\n  listen: 127.0.0.1:0\nadmin:\n  listen: 127.0.0.1:0\nsource:\n  kubernetes:\n    namespaces: [ml]\n",
        )
        .unwrap();
        KubeCheck {
            dir,
            home,
            pki,
            config,
        }
    }

    /// A kubeconfig file `name` whose one user is `user` (YAML), for a server at an address
    /// nothing answers.
    fn kubeconfig(&self, name: &str, user: &str) -> std::path::PathBuf {
        let path = self.dir.path().join(name);
        std::fs::write(
            &path,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: lab\n  cluster:\n    server: https://198.18.0.1:6443\n    certificate-authority: {}\n\
                 contexts:\n- name: lab\n  context: {{cluster: lab, user: ops}}\ncurrent-context: lab\n\
                 users:\n- name: ops\n  user: {user}\n",
                self.pki.ca_pem_path.display()
            ),
        )
        .unwrap();
        path
    }

    /// `check` with `kubeconfig` as KUBECONFIG (none: unset).
    fn check(
        &self,
        kubeconfig: Option<&std::path::Path>,
        offline: bool,
    ) -> (Option<i32>, String, String) {
        let mut env = vec![("HOME", self.home.as_os_str())];
        if let Some(k) = kubeconfig {
            env.push(("KUBECONFIG", k.as_os_str()));
        }
        let mut args = vec![
            "check".as_ref(),
            "--config".as_ref(),
            self.config.as_os_str(),
        ];
        if offline {
            args.push("--offline".as_ref());
        }
        run_in(&env, &args)
    }
}

/// The Kubernetes source's credentials are found as `serve` finds them (the kubeconfig,
/// else the pod's service account) and named; with none, `check` refuses with `serve`'s
/// words. Nothing is contacted: the kubeconfig's server is an address nothing answers.
#[test]
fn check_finds_the_kubernetes_source_s_credentials_without_contacting_the_api_server() {
    let k = KubeCheck::new();
    let kubeconfig = k.kubeconfig("kubeconfig", "{token: not-a-real-token}");
    let (code, stdout, stderr) = k.check(Some(&kubeconfig), false);
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("  credentials: https://198.18.0.1:6443/ (the kubeconfig)"),
        "{stdout}"
    );

    // A kubeconfig naming a certificate authority file that is not there: refused, as
    // the source would refuse it.
    let broken = k.dir.path().join("broken-kubeconfig");
    std::fs::write(
        &broken,
        std::fs::read_to_string(&kubeconfig).unwrap().replace(
            &format!("certificate-authority: {}", k.pki.ca_pem_path.display()),
            "certificate-authority: /nonexistent/ca.crt",
        ),
    )
    .unwrap();
    let (code, stdout, stderr) = k.check(Some(&broken), false);
    assert_eq!(
        code,
        Some(1),
        "a missing certificate was accepted:\n{stdout}"
    );
    assert!(
        stderr.contains("Kubernetes source") && stderr.contains("/nonexistent/ca.crt"),
        "{stderr}"
    );

    // No kubeconfig and no service account: refused, in serve's words.
    let (code, stdout, stderr) = k.check(None, false);
    assert_eq!(code, Some(1), "accepted without credentials:\n{stdout}");
    let message = stderr
        .trim_end()
        .strip_prefix("ray-xds check: ")
        .unwrap_or_else(|| panic!("{stderr}"));
    assert!(
        message.starts_with("Kubernetes source: no in-cluster service account"),
        "{message}"
    );
    let (code, _, serve_stderr) = run_in(
        &[("HOME", k.home.as_os_str())],
        &["serve".as_ref(), "--config".as_ref(), k.config.as_os_str()],
    );
    assert_ne!(code, Some(0), "serve started without credentials");
    assert!(
        serve_stderr.contains(message),
        "serve said\n{serve_stderr}\ncheck said\n{message}"
    );

    // --offline does not look.
    let (code, stdout, stderr) = k.check(None, true);
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("credentials: not looked for, --offline"),
        "{stdout}"
    );
}

/// A kubeconfig whose user runs an exec plugin for its token (a cloud's login): named,
/// never run (building a client runs it, and it may reach an identity provider or wait
/// for a login).
#[test]
fn check_names_a_kubeconfig_s_exec_plugin_and_does_not_run_it() {
    let k = KubeCheck::new();
    let ran = k.dir.path().join("plugin-ran");
    let plugin = k.dir.path().join("get-token.sh");
    std::fs::write(&plugin, format!("#!/bin/sh\ntouch {}\n", ran.display())).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&plugin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let with_plugin = k.kubeconfig(
        "plugin-kubeconfig",
        &format!(
            "{{exec: {{apiVersion: client.authentication.k8s.io/v1beta1, command: {}, interactiveMode: Never}}}}",
            plugin.display()
        ),
    );
    let (code, stdout, stderr) = k.check(Some(&with_plugin), false);
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    assert!(
        stdout.contains(&format!("exec plugin {}: not run", plugin.display())),
        "{stdout}"
    );
    assert!(!ran.exists(), "check ran the kubeconfig's exec plugin");
}
