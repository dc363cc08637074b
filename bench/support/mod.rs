//! Helpers the process-level benchmarks share (`fanout`, `scale`, `soak`): atomic file
//! edits, free ports, a bare admin-API GET, `/proc` readings and percentiles. Included by
//! each benchmark with `#[path = "support/mod.rs"] mod support;`, so a benchmark that
//! uses only some of them still builds without warnings.
#![allow(dead_code)]

use std::path::Path;
use std::time::Duration;

/// A services file of `proxies`, a RayService per hundred of them (one cluster each, its
/// first proxy the head).
pub fn services_of(proxies: &[std::net::SocketAddr]) -> String {
    let mut text = String::from("rayservices:\n");
    for (s, chunk) in proxies.chunks(100).enumerate() {
        text += &format!("  - name: s{s}\n    hosts: ['s{s}']\n    active_cluster: c\n    clusters:\n      - name: c\n        proxies:\n");
        for (i, p) in chunk.iter().enumerate() {
            text += &format!(
                "          - {{ address: {p}, node_type: {} }}\n",
                if i == 0 { "head" } else { "worker" }
            );
        }
    }
    text
}

/// Replaces `path` by a rename, so a reader never sees half a file.
pub fn write_atomic(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp~");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// A port free a moment ago, below the kernel's ephemeral range (see the test harness).
/// Unused where a benchmark takes it from `support::*` directly.
#[allow(unused_imports)]
pub use support::free_port;

/// A bare HTTP/1.0 GET on loopback, enough for the admin API: (status, body), or `None`
/// on any failure or after `deadline`. The server answers an HTTP/1.0 request with an
/// HTTP/1.0 status line and closes the connection.
pub async fn http_get(port: u16, path: &str, deadline: Duration) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    tokio::time::timeout(deadline, async {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        stream
            .write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
            .await
            .ok()?;
        let mut out = String::new();
        stream.read_to_string(&mut out).await.ok()?;
        let (head, body) = out.split_once("\r\n\r\n")?;
        let status = head.split_whitespace().nth(1)?.parse().ok()?;
        Some((status, body.to_string()))
    })
    .await
    .ok()?
}

/// Waits (up to a minute) for the ray-xds whose admin port is `admin` to answer
/// `/readyz` 200.
pub async fn wait_ready(admin: u16) {
    support::eventually("ray-xds is ready", Duration::from_secs(60), || async {
        support::http_get(&format!("http://127.0.0.1:{admin}/readyz"))
            .await
            .ok()
            .filter(|(s, _)| *s == 200)
    })
    .await;
}

/// The value of the series `key` (name and labels exactly as rendered) in a
/// Prometheus text exposition.
pub fn metric_value(text: &str, key: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let (k, v) = l.rsplit_once(' ')?;
        (k == key).then(|| v.parse().ok()).flatten()
    })
}

/// Resident set size of a process, KiB (0 once it is gone).
pub fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// User + system CPU seconds of a process.
pub fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0
}

/// Open file descriptors of a process.
pub fn open_fds(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count() as u64)
        .unwrap_or(0)
}

/// The `p` quantile (0..=1) of sorted durations, nearest rank; zero when empty.
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
