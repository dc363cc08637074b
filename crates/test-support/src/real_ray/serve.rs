//! Serve on a real-Ray cluster: the applications deployed (`serve deploy`), and what its
//! dashboard says of them (status, replicas, target groups), waited for.
//!
//! Invariant: every wait has a deadline and names what it waited for when it fails.

use super::*;

/// An application to deploy: `(name, route_prefix, import_path, args)`.
#[derive(Clone)]
pub struct App {
    pub name: &'static str,
    pub route_prefix: &'static str,
    /// `apps:hello`, `apps:slow` or `apps:broken` (tests/ray_apps/apps.py), or
    /// `grpc_apps:echo` (tests/ray_apps/grpc_apps.py, on a cluster started with gRPC).
    pub import_path: &'static str,
    /// Extra YAML for the application (e.g. `args: { delay_s: 15 }`).
    pub extra: &'static str,
}

impl App {
    pub const fn hello(route_prefix: &'static str) -> App {
        App {
            name: "hello",
            route_prefix,
            import_path: "apps:hello",
            extra: "",
        }
    }
}

impl RealRayCluster {
    /// Deploys applications with `serve deploy` (replacing any earlier config). Each
    /// replica knows its cluster's name (RAY_XDS_TEST_CLUSTER). On a cluster started with
    /// gRPC, Serve's `grpc_options` (which cannot change while Serve runs) are the same
    /// in every deploy, and each replica also knows the gRPC port and the stubs
    /// (RAY_XDS_GRPC_PORT, RAY_XDS_GRPC_STUBS, as `grpc_apps.py` reads them).
    pub fn deploy(&self, apps: &[App]) {
        self.deploy_at(apps, None);
    }

    /// [`RealRayCluster::deploy`] with Serve's `target_capacity` (percent) set, as
    /// KubeRay's incremental upgrade sets it.
    pub fn deploy_at(&self, apps: &[App], target_capacity: Option<u32>) {
        let mut yaml = format!(
            "proxy_location: EveryNode\nhttp_options: {{ host: 0.0.0.0, port: {} }}\n",
            self.serve_port
        );
        if let Some(percent) = target_capacity {
            yaml += &format!("target_capacity: {percent}\n");
        }
        let mut env_vars = format!("RAY_XDS_TEST_CLUSTER: {}", self.name);
        if let (Some(port), Some(stubs)) = (self.grpc_port, &self.grpc_stubs) {
            yaml += &format!(
                "grpc_options: {{ port: {port}, grpc_servicer_functions: [ray_xds.demo.echo_pb2_grpc.add_EchoServicer_to_server] }}\n"
            );
            env_vars += &format!(
                ", RAY_XDS_GRPC_PORT: \"{port}\", RAY_XDS_GRPC_STUBS: \"{}\"",
                stubs.display()
            );
        }
        yaml += "applications:\n";
        let working_dir = project_root().join("tests/ray_apps");
        for app in apps {
            yaml += &format!(
                "  - name: {}\n    route_prefix: {}\n    import_path: {}\n    runtime_env: {{ working_dir: \"local://{}\", env_vars: {{ {env_vars} }} }}\n",
                app.name,
                app.route_prefix,
                app.import_path,
                working_dir.display(),
            );
            if !app.extra.is_empty() {
                yaml += &format!("    {}\n", app.extra);
            }
        }
        let path = self.temp_dir.path().join("serve.yaml");
        std::fs::write(&path, yaml).unwrap();
        run(Command::new(serve_binary())
            .arg("deploy")
            .arg(&path)
            .arg("-a")
            .arg(self.dashboard_url()));
    }

    /// The dashboard's answer, as JSON (`Null` if it does not answer).
    pub async fn serve_status(&self) -> serde_json::Value {
        let url = format!("{}/api/serve/applications/", self.dashboard_url());
        match crate::http_get(&url).await {
            Ok((200, body)) => serde_json::from_str(&body).unwrap_or_default(),
            _ => serde_json::Value::Null,
        }
    }

    /// The targets of application `app`'s target group for `protocol` (`HTTP`, `gRPC`)
    /// that are ingress replicas (direct ingress), sorted.
    pub async fn replica_targets(&self, app: &str, protocol: &str) -> Vec<SocketAddr> {
        let status = self.serve_status().await;
        let mut out: Vec<SocketAddr> = status["target_groups"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|g| g["app_name"] == app && g["protocol"] == protocol)
            .flat_map(|g| g["targets"].as_array().cloned().unwrap_or_default())
            .filter(|t| {
                t["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("SERVE_REPLICA::"))
            })
            .filter_map(|t| format!("{}:{}", t["ip"].as_str()?, t["port"]).parse().ok())
            .collect();
        out.sort();
        out
    }

    /// Waits until application `app` has `n` ingress replicas listed for `protocol`.
    pub async fn wait_for_replicas(&self, app: &str, protocol: &str, n: usize) -> Vec<SocketAddr> {
        let started = Instant::now();
        loop {
            let targets = self.replica_targets(app, protocol).await;
            if targets.len() == n {
                return targets;
            }
            assert!(
                started.elapsed() < Duration::from_secs(180),
                "application {app} of {} never had {n} {protocol} replicas listed (now {targets:?}): {}",
                self.name,
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// What the dashboard says about application `app` (`None` until it lists it).
    pub async fn app_status(&self, app: &str) -> Option<String> {
        let (_, body) =
            crate::http_get(&format!("{}/api/serve/applications/", self.dashboard_url()))
                .await
                .ok()?;
        let v: serde_json::Value = serde_json::from_str(&body).ok()?;
        v["applications"][app]["status"]
            .as_str()
            .map(str::to_string)
    }

    /// Waits until application `app` has `status`.
    pub async fn wait_for_app(&self, app: &str, status: &str) {
        let started = Instant::now();
        while self.app_status(app).await.as_deref() != Some(status) {
            assert!(
                started.elapsed() < Duration::from_secs(180),
                "application {app} of {} never reached {status} (now {:?}): {}",
                self.name,
                self.app_status(app).await,
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}
