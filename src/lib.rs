//! ray-xds: an xDS control plane that keeps Envoy in front of Ray Serve.
//!
//! The modules follow the data flow, bottom layer first (no module names one above it:
//! ARCHITECTURE.md's layer table, checked by the `layers` test below):
//!
//! - [`policy`]: every tunable setting (probe, dashboard, traffic, switchover), declared
//!   once, with its default, range, flag and annotation;
//! - [`model`]: the domain model, free of Kubernetes and protobuf types;
//! - [`config`]: command line, environment and config file → a typed [`config::Config`];
//! - [`xds`]: Envoy's side only: versioned consistent snapshots, sans-IO ADS state
//!   machines (state of the world and delta) and the thin gRPC server around them;
//! - [`source`]: where RayServices come from (a watched `services.yaml`, or Kubernetes),
//!   each source the single writer of a [`model::Model`];
//! - [`live`]: what the running clusters say (proxy probes, dashboards, discovery) and
//!   [`live::health`], the one authority on each endpoint's health;
//! - [`translate`]: the pure function from a model and its health to Envoy resources;
//! - [`pipeline`]: the pure step from all inputs to a snapshot (switchover, departed
//!   clusters, withheld proxies), and the task that runs it;
//! - [`metrics`] and [`admin`]: Prometheus, health, readiness and debug views;
//! - [`supervisor`]: restarts a component that fails, counts it, shows it down;
//! - [`memory`]: gives the heap a burst of syncs freed back to the operating system;
//! - [`runtime`]: wiring, one shutdown token for everything;
//! - [`commands`]: the operator's commands beside `serve` (`check`, `status`).

pub(crate) mod admin;
pub(crate) mod admin_listener;
pub mod commands;
pub mod config;
pub mod live;
pub(crate) mod memory;
pub mod metrics;
pub mod model;
pub mod pipeline;
pub mod policy;
pub(crate) mod prestop;
pub(crate) mod ray_serve_api;
pub mod runtime;
pub mod source;
pub(crate) mod supervisor;
pub mod translate;

/// The xDS server crate, by the names the layers below use.
pub use xds_server as xds;
pub use xds_server::{budget, gate};

#[cfg(test)]
mod layers {
    //! ARCHITECTURE.md's layer table against the code: every `crate::` path in a module's
    //! code, inline or in a `use` line, tests included, goes to the module's own layer or
    //! one below; every module of this crate is in the table.

    use std::collections::BTreeMap;
    use std::path::{Path, PathBuf};

    /// The table's rows `| <n> | `a`, `b` | ...`: module → layer.
    fn layer_table() -> BTreeMap<String, u32> {
        let text =
            std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("ARCHITECTURE.md"))
                .unwrap();
        let section = text
            .split("## Layers")
            .nth(1)
            .and_then(|s| s.split("\n## ").next())
            .expect("ARCHITECTURE.md has a Layers section");
        let mut layers = BTreeMap::new();
        for row in section.lines().filter(|l| l.starts_with('|')) {
            let cells: Vec<&str> = row.split('|').map(str::trim).collect();
            let Some(Ok(layer)) = cells.get(1).map(|c| c.parse::<u32>()) else {
                continue;
            };
            for module in cells[2].split(',') {
                let module = module.trim().trim_matches('`');
                assert!(
                    layers.insert(module.to_string(), layer).is_none(),
                    "{module} is in two layers"
                );
            }
        }
        layers
    }

    fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                rust_files(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }

    /// The identifiers that follow `crate::` (or `$crate::`) in `code`.
    fn crate_paths(code: &str) -> Vec<&str> {
        code.match_indices("crate::")
            .filter(|(i, _)| {
                // Not `ray_xds_crate::` or the like: `crate` is a whole word.
                !code[..*i]
                    .chars()
                    .next_back()
                    .is_some_and(|c| c.is_alphanumeric() || c == '_')
            })
            .map(|(i, m)| {
                let rest = &code[i + m.len()..];
                let end = rest
                    .find(|c: char| !(c.is_alphanumeric() || c == '_'))
                    .unwrap_or(rest.len());
                &rest[..end]
            })
            .collect()
    }

    #[test]
    fn crate_paths_are_found_inline_and_in_use_lines() {
        assert_eq!(
            crate_paths("use crate::model::Model;\nlet x = crate::live::dashboards::X + $crate::policy::P; my_crate::xds"),
            ["model", "live", "policy"]
        );
    }

    #[test]
    fn every_crate_path_goes_to_its_own_layer_or_below() {
        let layers = layer_table();
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let lib = std::fs::read_to_string(src.join("lib.rs")).unwrap();
        let modules: Vec<&str> = lib
            .lines()
            .filter_map(|l| {
                let l = l.strip_prefix("pub(crate) ").unwrap_or(l);
                l.strip_prefix("pub ")
                    .unwrap_or(l)
                    .strip_prefix("mod ")?
                    .strip_suffix(';')
            })
            .collect();
        assert!(modules.len() > 10, "{modules:?}");
        for module in &modules {
            assert!(
                layers.contains_key(*module),
                "module {module} is in no layer of ARCHITECTURE.md"
            );
        }
        let mut files = Vec::new();
        rust_files(&src, &mut files);
        // Macros exported at the crate root belong to the module that defines them.
        let mut owner: BTreeMap<String, String> = BTreeMap::new();
        let module_of = |path: &Path| -> Option<String> {
            let relative = path.strip_prefix(&src).ok()?;
            let first = relative.components().next()?.as_os_str().to_str()?;
            Some(first.trim_end_matches(".rs").to_string())
        };
        for file in &files {
            let code = std::fs::read_to_string(file).unwrap();
            for line in code.lines() {
                if let Some(rest) = line.trim_start().strip_prefix("macro_rules! ") {
                    let name = rest.trim_end_matches(|c: char| c == '{' || c.is_whitespace());
                    owner.insert(name.to_string(), module_of(file).unwrap());
                }
            }
        }
        let mut checked = 0;
        let mut violations = Vec::new();
        for file in &files {
            let Some(from) = module_of(file).filter(|m| layers.contains_key(m)) else {
                continue; // lib.rs, main.rs: the crate's roots
            };
            let code = std::fs::read_to_string(file).unwrap();
            for target in crate_paths(&code) {
                let to = owner.get(target).map(String::as_str).unwrap_or(target);
                let Some(to_layer) = layers.get(to) else {
                    panic!("{}: crate::{target} is in no layer", file.display());
                };
                checked += 1;
                if *to_layer > layers[&from] {
                    violations.push(format!(
                        "{}: {from} (layer {}) names crate::{target} (layer {to_layer})",
                        file.display(),
                        layers[&from]
                    ));
                }
            }
        }
        assert!(checked > 100, "only {checked} paths found");
        assert!(violations.is_empty(), "{}", violations.join("\n"));
    }

    /// Comments state invariants; the history (which issue, which review) is git's.
    #[test]
    fn no_comment_tells_history() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut files = Vec::new();
        rust_files(&root.join("src"), &mut files);
        rust_files(&root.join("crates"), &mut files);
        let mut found = Vec::new();
        for file in files.iter().filter(|f| !f.ends_with("lib.rs")) {
            let code = std::fs::read_to_string(file).unwrap();
            for (n, line) in code.lines().enumerate() {
                let lower = line.to_lowercase();
                let words: Vec<&str> = lower
                    .split(|c: char| !c.is_alphanumeric() && c != '-')
                    .collect();
                let history = words.windows(2).any(|w| {
                    w[0] == "issue" && w[1].chars().next().is_some_and(|c| c.is_ascii_digit())
                }) || words.contains(&"re-check");
                if history {
                    found.push(format!("{}:{}: {}", file.display(), n + 1, line.trim()));
                }
            }
        }
        assert!(found.is_empty(), "{}", found.join("\n"));
    }
}
