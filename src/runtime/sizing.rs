//! Sizing: what ray-xds may need in open files and memory with a configuration's
//! limits, and the memory limit it runs under.
//!
//! Every need saturates rather than overflows; a shortfall is `Some(need)` only when the
//! limit is below the need. Reading the limit never fails: no readable limit is `None`.

use crate::config::Config;

/// Open files kept for probes: each proxy probed holds a kept-alive connection, and how
/// many proxies there will be is not known at start.
pub const OPEN_FILES_PROBE_RESERVE: u64 = 1_024;

/// Open files kept for the rest: the services file and its inotify watch, the API
/// server's watches, dashboard polls, the runtime's own (epoll, eventfd), logs.
pub const OPEN_FILES_OTHER_RESERVE: u64 = 64;

/// How many files ray-xds may hold open at once with `config`'s limits: every xDS
/// connection it accepts (`xds.max_connections`), every admin connection
/// ([`AdminLimits::max_connections`](crate::admin_listener::AdminLimits)),
/// [`OPEN_FILES_PROBE_RESERVE`] for probes and [`OPEN_FILES_OTHER_RESERVE`] for the rest.
pub fn open_files_needed(config: &Config) -> u64 {
    let xds = config.xds_limits.max_connections as u64;
    let admin = crate::admin_listener::AdminLimits::default().max_connections as u64;
    xds.saturating_add(admin)
        .saturating_add(OPEN_FILES_PROBE_RESERVE)
        .saturating_add(OPEN_FILES_OTHER_RESERVE)
}

/// What to warn of at start when the open-files `limit` (already raised to the hard one)
/// is below [`open_files_needed`]: the need, or `None` when the limit is enough. Past the
/// limit, accepts fail (the listeners pause and retry) and probes fail to connect.
pub fn open_files_shortfall(limit: u64, config: &Config) -> Option<u64> {
    let needed = open_files_needed(config);
    (limit < needed).then_some(needed)
}

/// What ray-xds may need in memory at most, roughly: twice the sum of the memory budgets
/// (what most of them count is an estimate, and real RSS runs above it for many small
/// values; the response bytes are real, and may reach twice their bound),
/// [`STREAM_BYTES`] for every ADS stream `xds.max_streams` allows, and
/// [`MEMORY_BASE_BYTES`] for the rest (probes, snapshots of a large fleet).
pub fn memory_needed(config: &Config) -> u64 {
    let m = config.memory;
    let budgets = (m.dashboards as u64)
        .saturating_add(m.route_tables as u64)
        .saturating_add(m.partial_xds_requests as u64)
        .saturating_add(m.xds_responses as u64);
    let streams = (config.xds_max_streams as u64).saturating_mul(STREAM_BYTES);
    budgets
        .saturating_mul(2)
        .saturating_add(streams)
        .saturating_add(MEMORY_BASE_BYTES)
}

/// What one ADS stream holds while its Envoy is in sync: 16 KiB (10-11 KiB measured at
/// 10,000 streams, docs/benchmarks.md; what it holds while a response is being written
/// is counted by `memory.xds_responses`).
pub const STREAM_BYTES: u64 = 16 << 10;

/// What ray-xds holds beside its budgets, roughly: 64 MiB.
pub const MEMORY_BASE_BYTES: u64 = 64 << 20;

/// What to warn of at start when the container's memory `limit` is below
/// [`memory_needed`]: the need, or `None` when the limit is enough. Past the limit the
/// kernel kills the process; lower the `memory.*` budgets or raise the limit.
pub fn memory_shortfall(limit: u64, config: &Config) -> Option<u64> {
    let needed = memory_needed(config);
    (limit < needed).then_some(needed)
}

/// The memory limit of this process's cgroup (v2 `memory.max`, else v1's), if it has one.
pub fn cgroup_memory_limit() -> Option<u64> {
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    memory_limit_files(&own)
        .iter()
        .find_map(|path| std::fs::read_to_string(path).ok())
        .and_then(|text| text.trim().parse::<u64>().ok())
        // cgroup v1 writes a huge number for "no limit" (v2 writes `max`).
        .filter(|limit| *limit < (1 << 60))
}

/// Where this process's memory limit may be read, most specific first, from its
/// `/proc/self/cgroup`: its own cgroup's file (v2 `0::<path>`, v1 `<n>:memory:<path>`),
/// then the mount roots' (a container with its own cgroup namespace sees itself there).
pub fn memory_limit_files(proc_self_cgroup: &str) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for line in proc_self_cgroup.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let path = path.trim_start_matches('/');
        if path.is_empty() || path.split('/').any(|part| part == "..") {
            continue; // the root (below), or not a path to follow
        }
        if controllers.is_empty() {
            files.push(format!("/sys/fs/cgroup/{path}/memory.max").into());
        } else if controllers.split(',').any(|c| c == "memory") {
            files.push(format!("/sys/fs/cgroup/memory/{path}/memory.limit_in_bytes").into());
        }
    }
    files.push("/sys/fs/cgroup/memory.max".into());
    files.push("/sys/fs/cgroup/memory/memory.limit_in_bytes".into());
    files
}
