//! The `ray-xds` binary: parse the command line, start the runtime, stop on a signal.

use clap::Parser;
use ray_xds::config::{Cli, Command, Config};
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            // rustls logs a line per malformed handshake: anyone who can reach the xDS
            // port could fill the log. ray-xds logs failed handshakes itself, rate-limited.
            tracing_subscriber::EnvFilter::try_from_env("RAY_XDS_LOG")
                .unwrap_or_else(|_| "info,rustls=error".into()),
        )
        .init();
    // Every proxy probed over a kept-alive connection holds a file descriptor: take all
    // the process may have (the soft limit is often 1,024; the hard one far more).
    let open_files = match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => {
            tracing::debug!(limit, "open files limit");
            Some(limit)
        }
        Err(err) => {
            tracing::warn!(%err, "cannot raise the open files limit");
            rlimit::Resource::NOFILE.get().ok().map(|(soft, _)| soft)
        }
    };
    let args = match Cli::parse().command {
        Command::Serve(args) => args,
        Command::Check(args) => {
            let outcome = ray_xds::commands::check::check(&args)
                .await
                .map_err(|e| e.to_string());
            return report("check", outcome);
        }
        Command::Status(args) => {
            return match ray_xds::commands::status::run(&args).await {
                Ok(rendered) if rendered.partial => {
                    print!("{}", rendered.text);
                    eprintln!("ray-xds status: a page could not be read: shown as unavailable");
                    std::process::ExitCode::from(3)
                }
                outcome => report(
                    "status",
                    outcome.map(|r| r.text).map_err(|e| format!("{e:#}")),
                ),
            };
        }
    };
    let config = match Config::load(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("ray-xds: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    if let Some(limit) = open_files {
        if let Some(needed) = ray_xds::runtime::open_files_shortfall(limit, &config) {
            tracing::warn!(
                limit,
                needed,
                xds_max_connections = config.xds_limits.max_connections,
                "the open files limit is below what the configured limits may need at once \
                 (xDS and admin connections, a kept-alive connection per probed proxy, files \
                 and watches): raise the hard limit (ulimit -n, LimitNOFILE) or lower \
                 xds.max_connections"
            );
        }
    }
    if let Some(limit) = ray_xds::runtime::cgroup_memory_limit() {
        if let Some(needed) = ray_xds::runtime::memory_shortfall(limit, &config) {
            tracing::warn!(
                limit,
                needed,
                "the container's memory limit is below what the memory budgets may need \
                 and the streams (twice the budgets' sum, 16 KiB per stream of xds.max_streams, \
                 plus 64 MiB): lower memory.* or xds.max_streams, or raise the limit"
            );
        }
    }
    let shutdown = CancellationToken::new();
    tokio::spawn(stop_on_signal(shutdown.clone()));
    let result = match ray_xds::runtime::start(config, shutdown).await {
        Ok(running) => running.wait().await,
        Err(e) => Err(e),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ray-xds: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// An operator command's outcome: its text on stdout and 0, or its error on stderr
/// (after `ray-xds <command>: `) and 1.
fn report(command: &str, outcome: Result<String, String>) -> std::process::ExitCode {
    match outcome {
        Ok(text) => {
            print!("{text}");
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("ray-xds {command}: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn stop_on_signal(shutdown: CancellationToken) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    tracing::info!("shutting down");
    shutdown.cancel();
}
