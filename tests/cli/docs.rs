//! The documentation's reference tables say what the code does: every policy setting
//! (flag, environment variable, config field, annotation, default, range) in
//! `docs/configuration.md` and every annotation in `docs/kubernetes.md` are listed exactly
//! as `policy` and the Kubernetes source declare them. On a mismatch the test prints the
//! table the code implies, to paste into the page. The README stays a front door.

use ray_xds::policy::{all_fields, Scope};
use ray_xds::source::kubernetes::annotations;

fn page(path: &str) -> String {
    std::fs::read_to_string(support::project_root().join(path)).unwrap()
}

/// The text between `<!-- name:start -->` and `<!-- name:end -->`.
fn section<'a>(text: &'a str, name: &str) -> &'a str {
    let start = format!("<!-- {name}:start -->\n");
    let end = format!("<!-- {name}:end -->");
    let from = text.find(&start).unwrap_or_else(|| panic!("no {start}")) + start.len();
    let to = text[from..]
        .find(&end)
        .unwrap_or_else(|| panic!("no {end}"))
        + from;
    &text[from..to]
}

fn assert_section(path: &str, name: &str, expected: String) {
    let text = page(path);
    let actual = section(&text, name);
    assert!(
        actual == expected,
        "{path}'s {name} table is out of date; the code says:\n\n{expected}"
    );
}

#[test]
fn the_policy_reference_lists_every_setting_as_the_code_declares_it() {
    let mut expected = String::from(
        "| config field | flag | environment | annotation | default | allowed | what |\n|---|---|---|---|---|---|---|\n",
    );
    for f in all_fields() {
        let annotation = match f.scope {
            Scope::Service => format!("`ray-xds.io/{}`", f.annotation.unwrap()),
            Scope::Global => "(global only)".into(),
        };
        expected += &format!(
            "| `{}` | `--{}` | `{}` | {} | `{}` | {} | {} |\n",
            f.path(),
            f.flag,
            f.env(),
            annotation,
            (f.default)(),
            (f.range)(),
            f.doc
        );
    }
    assert_section("docs/configuration.md", "policy-reference", expected);
}

#[test]
fn the_annotation_table_lists_every_annotation_the_source_reads() {
    let mut expected = String::from("| annotation | value | overrides |\n|---|---|---|\n");
    for (name, value, what) in annotations::OWN {
        expected += &format!("| `ray-xds.io/{name}` | {value} | {what} |\n");
    }
    for f in all_fields().filter(|f| f.scope == Scope::Service) {
        expected += &format!(
            "| `ray-xds.io/{}` | {} | `{}` |\n",
            f.annotation.unwrap(),
            (f.range)(),
            f.path()
        );
    }
    assert_section("docs/kubernetes.md", "annotations", expected);
}
