//! Real Envoy processes for tests: the binary (installed on first use), a bootstrap from
//! `envoy/` rendered with the test's own ports and `--base-id`, its admin API, and
//! children that die with the test.
//!
//! Invariant: every process spawned here is killed when its guard drops.

use super::*;

/// The real Envoy binary, installed by `scripts/install-envoy.sh` on first use.
pub fn envoy_binary() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        if let Ok(p) = std::env::var("RAY_XDS_ENVOY") {
            return PathBuf::from(p);
        }
        let out = Command::new("bash")
            .arg(project_root().join("scripts/install-envoy.sh"))
            .stderr(Stdio::inherit())
            .output()
            .expect("running scripts/install-envoy.sh");
        assert!(out.status.success(), "installing Envoy failed");
        PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
    })
    .clone()
}

/// A child process killed when dropped, and (through PR_SET_PDEATHSIG) when the test
/// process dies.
pub struct ChildGuard {
    pub child: Child,
    pub name: String,
}

pub fn spawn(name: &str, cmd: &mut Command) -> ChildGuard {
    use std::os::unix::process::CommandExt;
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("starting {name}: {e}"));
    ChildGuard {
        child,
        name: name.into(),
    }
}

/// A `--base-id` no other Envoy of this or another test process uses now: pid * 64 + n,
/// n counting every Envoy this process starts (every Envoy of a test process must take
/// its id here: two counters of the same scheme in one process gave two live Envoys the
/// same id, and the second could not start).
pub fn base_id() -> u32 {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 64;
    std::process::id() * 64 + n
}

impl Drop for Envoy {
    /// A failing test shows what Envoy said.
    fn drop(&mut self) {
        if std::thread::panicking() {
            let text = self.log_text();
            let tail: Vec<&str> = text.lines().rev().take(40).collect();
            eprintln!("--- last lines of Envoy's log ---");
            for line in tail.into_iter().rev() {
                eprintln!("{line}");
            }
        }
    }
}

impl ChildGuard {
    pub fn signal(&self, sig: i32) {
        unsafe {
            libc::kill(self.child.id() as i32, sig);
        }
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Which bootstrap from `envoy/` an Envoy runs.
#[derive(Clone, Copy, Debug)]
pub enum Bootstrap {
    Sotw,
    Delta,
    /// State of the world over mTLS (`envoy/bootstrap-tls.yaml`): render it with
    /// [`Bootstrap::with_tls_files`].
    SotwTls,
}

impl Bootstrap {
    pub fn file(self) -> &'static str {
        match self {
            Bootstrap::Sotw => "bootstrap.yaml",
            Bootstrap::Delta => "bootstrap-delta.yaml",
            Bootstrap::SotwTls => "bootstrap-tls.yaml",
        }
    }

    pub fn protocol(self) -> &'static str {
        match self {
            Bootstrap::Sotw => "sotw",
            Bootstrap::Delta => "delta",
            Bootstrap::SotwTls => "sotw",
        }
    }

    /// An edit for [`Envoy::start_with`]: the TLS bootstrap's certificate files are
    /// `cert`, `key` and `ca` instead of `/etc/envoy/xds-tls/*`.
    pub fn with_tls_files(cert: &Path, key: &Path, ca: &Path) -> impl FnOnce(String) -> String {
        let (cert, key, ca) = (
            cert.display().to_string(),
            key.display().to_string(),
            ca.display().to_string(),
        );
        move |bootstrap: String| {
            assert!(bootstrap.contains("/etc/envoy/xds-tls/tls.crt"));
            bootstrap
                .replace("/etc/envoy/xds-tls/tls.crt", &cert)
                .replace("/etc/envoy/xds-tls/tls.key", &key)
                .replace("/etc/envoy/xds-tls/ca.crt", &ca)
        }
    }
}

pub struct Envoy {
    pub process: ChildGuard,
    pub admin_port: u16,
    pub log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Envoy {
    /// Starts Envoy from `envoy/<bootstrap>`, rendered with the given xDS port, its admin on
    /// a port Envoy picks itself (read back from `--admin-address-path`, so no other test
    /// can take it in between) and a base id unique to this process and Envoy.
    pub fn start(bootstrap: Bootstrap, xds_port: u16) -> Envoy {
        Envoy::start_with(bootstrap, xds_port, |b| b)
    }

    /// Like [`Envoy::start`], with the rendered bootstrap passed through `edit` first.
    pub fn start_with(
        bootstrap: Bootstrap,
        xds_port: u16,
        edit: impl FnOnce(String) -> String,
    ) -> Envoy {
        let dir = tempfile::tempdir().unwrap();
        let template =
            std::fs::read_to_string(project_root().join("envoy").join(bootstrap.file())).unwrap();
        assert!(template.contains("port_value: 18000") && template.contains("port_value: 9901"));
        let rendered = template
            .replace("port_value: 18000", &format!("port_value: {xds_port}"))
            .replace("port_value: 9901", "port_value: 0");
        let config = dir.path().join("envoy.yaml");
        std::fs::write(&config, edit(rendered)).unwrap();
        let log = dir.path().join("envoy.log");
        let admin_file = dir.path().join("admin-address");
        let base_id = base_id();
        let mut process = spawn(
            "envoy",
            Command::new(envoy_binary())
                .arg("-c")
                .arg(&config)
                .args(["--base-id", &base_id.to_string()])
                // No hot restart, so no shared memory: a SIGKILLed Envoy leaves its
                // /dev/shm region behind, and a later process with a recycled pid (so
                // the same base id) failed to start on it, saying so only on stderr.
                .arg("--disable-hot-restart")
                .arg("--admin-address-path")
                .arg(&admin_file)
                .args([
                    "--log-level",
                    &std::env::var("TEST_ENVOY_LOG_LEVEL").unwrap_or_else(|_| "info".into()),
                    "--log-path",
                ])
                .arg(&log)
                .args(["--concurrency", "1", "--file-flush-interval-msec", "200"])
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(dir.path().join("envoy.stderr")).unwrap()),
        );
        let started = Instant::now();
        let admin_port = loop {
            let text = std::fs::read_to_string(&admin_file).unwrap_or_default();
            if let Some(port) = text
                .trim()
                .rsplit(':')
                .next()
                .and_then(|p| p.parse::<u16>().ok())
                .filter(|p| *p != 0)
            {
                break port;
            }
            if !process.is_running() || started.elapsed() > Duration::from_secs(60) {
                let log_text = std::fs::read_to_string(&log).unwrap_or_default();
                let stderr =
                    std::fs::read_to_string(dir.path().join("envoy.stderr")).unwrap_or_default();
                panic!("Envoy did not start its admin: {log_text}\nstderr: {stderr}");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        Envoy {
            process,
            admin_port,
            log,
            _dir: dir,
        }
    }

    /// The port Envoy's `ray-serve-http` listener bound (ray-xds gives it port 0 in tests).
    pub async fn gateway_port(&self) -> u16 {
        eventually(
            "Envoy binds the ray-serve-http listener",
            Duration::from_secs(30),
            || async {
                let text = self.admin("/listeners?format=json").await;
                let v: serde_json::Value = serde_json::from_str(&text).ok()?;
                v["listener_statuses"]
                    .as_array()?
                    .iter()
                    .find_map(|l| {
                        (l["name"] == "ray-serve-http")
                            .then(|| l["local_address"]["socket_address"]["port_value"].as_u64())?
                    })
                    .map(|p| p as u16)
                    .filter(|p| *p != 0)
            },
        )
        .await
    }

    pub async fn admin(&self, path: &str) -> String {
        let (status, body) = http_get(&format!("http://127.0.0.1:{}{path}", self.admin_port))
            .await
            .unwrap_or((0, String::new()));
        assert!(status == 200 || status == 0, "envoy admin {path}: {status}");
        body
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// One of Envoy's stats (a counter or gauge), 0 when Envoy has none by that name.
    pub async fn stat(&self, name: &str) -> u64 {
        let text = self.admin("/stats").await;
        text.lines()
            .find_map(|l| {
                l.strip_prefix(name)?
                    .strip_prefix(": ")?
                    .trim()
                    .parse()
                    .ok()
            })
            .unwrap_or(0)
    }

    /// Envoy's `/config_dump` as JSON.
    pub async fn config_dump(&self) -> serde_json::Value {
        serde_json::from_str(&self.admin("/config_dump").await).unwrap_or_default()
    }
}
