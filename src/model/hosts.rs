//! Which hosts each namespace's RayServices may claim, when namespaces are owners
//! ([`HostPolicy`]), and when one host pattern lies within another ([`host_within`]).
//!
//! A policy's patterns are valid virtual-host domains, lowercase, and at most
//! [`MAX_HOST_PATTERNS`] in all; its namespaces are DNS labels.

use std::collections::BTreeMap;

use super::names::{is_dns_label, validate_host};

/// Which hosts each namespace's RayServices may claim, when namespaces are owners (the
/// Kubernetes source: `source.kubernetes.allowed_hosts`). A RayService may always claim
/// `<name>.<namespace>` and `<name>.<namespace>.svc`; beyond them, only hosts within a
/// pattern its namespace is given: a name, `*.suffix` (any name ending so, and wildcards
/// narrower than it), `prefix.*`, or `*` (everything). No namespace has `*` unless given.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostPolicy {
    /// Namespace → host patterns, lowercase.
    pub namespaces: BTreeMap<String, Vec<String>>,
}

/// At most this many patterns in all (a policy is written by hand).
pub const MAX_HOST_PATTERNS: usize = 10_000;

impl HostPolicy {
    /// A policy from the config file's map, each pattern checked as a virtual-host domain.
    pub fn new(namespaces: BTreeMap<String, Vec<String>>) -> Result<HostPolicy, String> {
        let total: usize = namespaces.values().map(Vec::len).sum();
        if total > MAX_HOST_PATTERNS {
            return Err(format!(
                "{total} host patterns: at most {MAX_HOST_PATTERNS}"
            ));
        }
        let mut out = BTreeMap::new();
        for (namespace, patterns) in namespaces {
            if !is_dns_label(&namespace) {
                return Err(format!(
                    "namespace {namespace:?} is not a DNS label (lowercase letters, digits and '-', at most 63)"
                ));
            }
            let mut lower = Vec::with_capacity(patterns.len());
            for pattern in patterns {
                validate_host(&pattern).map_err(|e| format!("namespace {namespace}: {e}"))?;
                lower.push(pattern.to_ascii_lowercase());
            }
            out.insert(namespace, lower);
        }
        Ok(HostPolicy { namespaces: out })
    }

    /// Whether RayService `namespace/name` may claim `host`.
    pub(crate) fn allows(&self, namespace: &str, name: &str, host: &str) -> bool {
        let host = host.to_ascii_lowercase();
        let own = |ns: &str| {
            self.namespaces
                .get(ns)
                .is_some_and(|patterns| patterns.iter().any(|p| host_within(&host, p)))
        };
        if own(namespace) {
            return true;
        }
        if host == format!("{name}.{namespace}") || host == format!("{name}.{namespace}.svc") {
            // A default name is the RayService's unless the policy gives it to another
            // namespace (namespace `com`, RayService `example`: `example.com`). A `*`
            // grant is the catch-all, and gives no name away.
            return !self.namespaces.iter().any(|(ns, patterns)| {
                ns != namespace && patterns.iter().any(|p| p != "*" && host_within(&host, p))
            });
        }
        false
    }

    /// What `namespace` may claim, for messages.
    pub(crate) fn describe(&self, namespace: &str, name: &str) -> String {
        let mut allowed = vec![
            format!("{name}.{namespace}"),
            format!("{name}.{namespace}.svc"),
        ];
        allowed.extend(
            self.namespaces
                .get(namespace)
                .into_iter()
                .flatten()
                .cloned(),
        );
        allowed.join(", ")
    }
}

/// Whether every name `host` (a name or a virtual-host wildcard, lowercase) matches also
/// matches `pattern` (lowercase).
pub fn host_within(host: &str, pattern: &str) -> bool {
    if pattern == "*" || host == pattern {
        return true;
    }
    if let Some(suffix) = pattern.strip_prefix('*') {
        return host.len() > suffix.len() && host.ends_with(suffix);
    }
    if let Some(prefix) = pattern.strip_suffix('*') {
        return host.len() > prefix.len() && host.starts_with(prefix);
    }
    host == pattern
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_policy_defaults_to_the_rayservice_s_own_names() {
        let none = HostPolicy::default();
        assert!(none.allows("ml", "llm", "llm.ml"));
        assert!(none.allows("ml", "llm", "LLM.ml.svc"));
        for refused in [
            "llm.other",
            "other.ml",
            "*",
            "*.ml",
            "llm.ml.svc.cluster.local",
            "example.com",
        ] {
            assert!(!none.allows("ml", "llm", refused), "{refused}");
        }
    }

    #[test]
    fn host_patterns_cover_names_and_narrower_wildcards_only() {
        let p = HostPolicy::new(BTreeMap::from([
            (
                "team-a".to_string(),
                vec!["*.Team-A.example.com".to_string(), "api.example.com".into()],
            ),
            ("edge".to_string(), vec!["*".to_string()]),
            ("docs".to_string(), vec!["docs.*".to_string()]),
        ]))
        .unwrap();
        for ok in [
            "x.team-a.example.com",
            "a.b.team-a.example.com",
            "*.team-a.example.com",
            "*.x.team-a.example.com",
            "*-x.team-a.example.com",
            "API.example.com",
        ] {
            assert!(p.allows("team-a", "llm", ok), "{ok}");
        }
        for refused in [
            "team-a.example.com",
            "*.example.com",
            "*",
            "xteam-a.example.com",
            "api.example.com.evil",
            "example.com",
            "docs.example.com",
        ] {
            assert!(!p.allows("team-a", "llm", refused), "{refused}");
        }
        assert!(p.allows("edge", "gw", "*"));
        assert!(p.allows("edge", "gw", "anything.example"));
        assert!(p.allows("docs", "d", "docs.example.com"));
        assert!(p.allows("docs", "d", "docs.*"));
        assert!(!p.allows("docs", "d", "*"));
        assert!(!p.allows("docs", "d", "doc.*"));
        // Another namespace's patterns give nothing.
        assert!(!p.allows("team-b", "llm", "x.team-a.example.com"));
        assert_eq!(
            p.describe("team-a", "llm"),
            "llm.team-a, llm.team-a.svc, *.team-a.example.com, api.example.com"
        );
    }

    #[test]
    fn host_policies_are_checked() {
        let bad = |ns: &str, p: &str| {
            HostPolicy::new(BTreeMap::from([(ns.to_string(), vec![p.to_string()])])).unwrap_err()
        };
        assert!(bad("team-a", "*.*").contains("not a valid virtual-host domain"));
        assert!(bad("team-a", "a b").contains("not a valid"));
        assert!(bad("Team_A", "a.example").contains("not a DNS label"));
        let many: Vec<String> = (0..=MAX_HOST_PATTERNS)
            .map(|i| format!("h{i}.example"))
            .collect();
        assert!(HostPolicy::new(BTreeMap::from([("a".to_string(), many)]))
            .unwrap_err()
            .contains("at most"));
    }

    proptest::proptest! {
        /// A host within a pattern matches only names the pattern matches: checked on
        /// concrete names drawn from a small alphabet, so that overlaps are common.
        #[test]
        fn a_host_within_a_pattern_matches_nothing_the_pattern_does_not(
            host in "(\\*|[ab.]{1,4}\\*|\\*[ab.]{1,4}|[ab.]{1,5})",
            pattern in "(\\*|[ab.]{1,4}\\*|\\*[ab.]{1,4}|[ab.]{1,5})",
            names in proptest::collection::vec("[ab.]{1,7}", 1..40),
        ) {
            fn matches(name: &str, p: &str) -> bool {
                if p == "*" { return true; }
                if let Some(s) = p.strip_prefix('*') { return name.len() > s.len() && name.ends_with(s); }
                if let Some(s) = p.strip_suffix('*') { return name.len() > s.len() && name.starts_with(s); }
                name == p
            }
            if host_within(&host, &pattern) {
                for name in &names {
                    if matches(name, &host) {
                        proptest::prop_assert!(matches(name, &pattern), "{name} matches {host} but not {pattern}");
                    }
                }
            }
        }
    }
}
