//! Golden files of the resources `translate` produces, as proto JSON (what
//! `/debug/snapshot` shows and Envoy's `/config_dump` prints). A change to the output fails here
//! until the golden file is regenerated (`UPDATE_GOLDEN=1 cargo test --test
//! xds golden`) and the diff is reviewed by eye.

use std::path::{Path, PathBuf};

use ray_xds::config::GatewaySettings;
use ray_xds::source::file;
use ray_xds::translate::translate;
use ray_xds::xds::{ResourceType, Snapshot};

fn golden(name: &str, services: &Path) {
    let text = std::fs::read_to_string(services).unwrap();
    let model = file::parse(services, &text).unwrap();
    let snapshot = Snapshot::from_resources(&translate(
        &model,
        &Default::default(),
        &Default::default(),
        &GatewaySettings::default(),
        &Default::default(),
    ));
    let mut resources = Vec::new();
    for ty in ResourceType::ALL {
        for r in snapshot.resources(ty).values() {
            resources.push(serde_json::json!({
                "type": ty.label(),
                "name": &*r.name,
                "version": &*r.version,
                "resource": r.to_json(),
            }));
        }
    }
    let out = serde_json::to_string_pretty(&serde_json::json!({
        "version": snapshot.version(),
        "resources": resources,
    }))
    .unwrap()
        + "\n";
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(format!("{name}.json"));
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &out).unwrap();
    }
    let want = std::fs::read_to_string(&path)
        .unwrap_or_else(|_| panic!("{} missing: run with UPDATE_GOLDEN=1", path.display()));
    pretty_assertions::assert_eq!(
        want,
        out,
        "translate output changed: review, then UPDATE_GOLDEN=1"
    );
}

#[test]
fn demo_example() {
    golden(
        "demo",
        &PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/services.yaml"),
    );
}

#[test]
fn two_services_with_a_pending_cluster() {
    golden(
        "two-services",
        &PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden/two-services.yaml"),
    );
}
