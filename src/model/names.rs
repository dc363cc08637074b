//! The names a model holds and their checks: DNS labels (namespaces, RayService and
//! RayCluster names), virtual-host domains, application names and route prefixes; and
//! the Envoy cluster names built from them.
//!
//! A name that passes its check is one Envoy takes as it is; an application name goes
//! into a cluster name only through [`encode_name_segment`], so two names never give one
//! Envoy cluster name.

use super::{Protocol, RayService};

/// The longest application name and route prefix a model holds: shorter than what a
/// dashboard answer's strings are cut to (`live::dashboard::MAX_STRING_BYTES`, 1,024 bytes,
/// at a character boundary), so a cut name or prefix is refused, never routed as another.
pub const MAX_APPLICATION_NAME_BYTES: usize = 256;
pub const MAX_ROUTE_PREFIX_BYTES: usize = 1000;

/// Whether `prefix` can be an application's HTTP route: Ray's own rule (it starts with
/// `/`), and nothing Envoy's path matchers refuse or a path never holds (`?`, `#`,
/// whitespace, control characters).
pub fn check_route_prefix(prefix: &str) -> Result<(), String> {
    if !prefix.starts_with('/') {
        return Err(format!("route prefix {prefix:?} does not start with '/'"));
    }
    if prefix.len() > MAX_ROUTE_PREFIX_BYTES {
        return Err(format!(
            "route prefix of {} bytes: at most {MAX_ROUTE_PREFIX_BYTES}",
            prefix.len()
        ));
    }
    if let Some(c) = prefix
        .chars()
        .find(|c| matches!(c, '?' | '#') || c.is_whitespace() || c.is_control())
    {
        return Err(format!("route prefix {prefix:?} holds {c:?}"));
    }
    Ok(())
}

/// Whether `name` can be an application's: not empty, at most
/// [`MAX_APPLICATION_NAME_BYTES`], no control characters (it goes into Envoy cluster
/// names, encoded by [`encode_name_segment`], and into a header match).
pub fn check_application_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("an empty application name".into());
    }
    if name.len() > MAX_APPLICATION_NAME_BYTES {
        return Err(format!(
            "application name of {} bytes: at most {MAX_APPLICATION_NAME_BYTES}",
            name.len()
        ));
    }
    if name.chars().any(char::is_control) {
        return Err(format!(
            "application name {name:?} holds a control character"
        ));
    }
    Ok(())
}

/// `name` as one segment of an Envoy cluster name: letters, digits, `-`, `_` and `.`
/// as they are, every other byte `%XX`, so no two names give the same segment and none
/// holds `/` (stand-in patterns match a segment with `*`).
pub fn encode_name_segment(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl RayService {
    /// The Envoy cluster name of one of this service's RayClusters.
    pub(crate) fn envoy_cluster_name(&self, cluster: &str) -> String {
        format!("{}/{}/{}", self.namespace, self.name, cluster)
    }

    /// The Envoy cluster of a RayCluster's gRPC proxies: `<namespace>/<name>/<cluster>/grpc`
    /// (a cluster name is a DNS label, so this never names an HTTP cluster).
    pub(crate) fn envoy_grpc_cluster_name(&self, cluster: &str) -> String {
        format!("{}/{}/{}/grpc", self.namespace, self.name, cluster)
    }

    /// The Envoy cluster of one of a RayCluster's endpoints.
    pub(crate) fn envoy_cluster_name_for(&self, cluster: &str, protocol: Protocol) -> String {
        match protocol {
            Protocol::Http => self.envoy_cluster_name(cluster),
            Protocol::Grpc => self.envoy_grpc_cluster_name(cluster),
        }
    }

    /// The Envoy cluster of an application's ingress replicas in a RayCluster:
    /// `<namespace>/<name>/<cluster>/app/<application>` for HTTP, `.../grpc` after it for
    /// gRPC (the application's name encoded as one segment, [`encode_name_segment`]).
    pub(crate) fn envoy_app_cluster_name(
        &self,
        cluster: &str,
        app: &str,
        protocol: Protocol,
    ) -> String {
        let http = format!(
            "{}/{}/{}/app/{}",
            self.namespace,
            self.name,
            cluster,
            encode_name_segment(app)
        );
        match protocol {
            Protocol::Http => http,
            Protocol::Grpc => http + "/grpc",
        }
    }
}

pub(super) fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// Envoy accepts `*`, a prefix wildcard (`*.example.com`), a suffix wildcard
/// (`example.*`) or a plain host, optionally with a port.
/// Whether `host` is a virtual-host domain Envoy takes: a name, `*`, `*.suffix` or
/// `prefix.*` (ASCII letters, digits, `.`, `-`, `:`, `_`).
pub fn check_host(host: &str) -> Result<(), String> {
    validate_host(host)
}

pub(super) fn validate_host(host: &str) -> Result<(), String> {
    if host == "*" {
        return Ok(());
    }
    let body = host
        .strip_prefix('*')
        .or_else(|| host.strip_suffix('*'))
        .unwrap_or(host);
    let ok = !body.is_empty()
        && !body.contains('*')
        && body
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b':' | b'_'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "host {host:?} is not a valid virtual-host domain (a name, '*', '*.suffix' or 'prefix.*')"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn application_names_are_one_cluster_name_segment_each() {
        assert_eq!(encode_name_segment("work_v2.1-a"), "work_v2.1-a");
        assert_eq!(encode_name_segment("a/b c%"), "a%2Fb%20c%25");
        assert_eq!(encode_name_segment("é"), "%C3%A9");
        assert_ne!(encode_name_segment("a%2F"), encode_name_segment("a/"));
    }
}
