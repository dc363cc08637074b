//! Policy: every tunable setting of ray-xds's behaviour towards Ray and Envoy, declared
//! once.
//!
//! Each policy ([`probe`], [`dashboard`], [`traffic`], [`switchover`]) is declared with
//! [`declare_policy!`]: one line per setting gives its name, type, default, allowed range,
//! command-line flag and (for settings a RayService may override) its `ray-xds.io/`
//! annotation. From that line come the typed policy struct and its default, the override
//! struct that both `ray-xds.yaml` (the global section) and `services.yaml` (one
//! RayService's section) deserialize, the flag and its environment variable, the
//! annotation, the range check and the reference rows of docs/configuration.md ([`Field`]).
//!
//! Invariants: a value is checked by the same rule wherever it comes from (flag,
//! environment, either YAML file, annotation), and an override that passed
//! [`validate`](TrafficOverrides::validate) gives, with [`with`](TrafficPolicy::with), a
//! policy whose every field is in range, so no arithmetic on it downstream can overflow.
//! This module imports nothing else of ray-xds.

pub(crate) mod dashboard;
pub mod probe;
pub mod switchover;
pub mod traffic;
mod value;

pub use value::{deserialize_some, Steps, Value, MAX_STEPS};

/// Whether a RayService may override a setting, or only the global configuration sets it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// `ray-xds.yaml`, a flag or its environment variable, and per RayService
    /// (`services.yaml` or an annotation).
    Service,
    /// `ray-xds.yaml`, a flag or its environment variable only.
    Global,
}

/// One setting, as docs/configuration.md's reference table and `--help` describe it.
#[derive(Clone, Copy, Debug)]
pub struct Field {
    /// The YAML section: `probe`, `dashboard`, `traffic`, `switchover`.
    pub section: &'static str,
    /// The YAML key, e.g. `per_try_timeout`.
    pub name: &'static str,
    /// The command-line flag without its dashes, e.g. `per-try-timeout`.
    pub flag: &'static str,
    /// The annotation without its `ray-xds.io/` prefix, for [`Scope::Service`] settings.
    pub annotation: Option<&'static str>,
    pub scope: Scope,
    /// What it does: the doc comment's first sentence.
    pub doc: &'static str,
    /// The default, written as a user would write it (`10s`, `3`, `atomic`).
    pub default: fn() -> String,
    /// The allowed values, e.g. `0s..=24h`, or what the type allows.
    pub range: fn() -> String,
}

impl Field {
    /// `RAY_XDS_` and the flag in upper snake case.
    pub fn env(&self) -> String {
        format!(
            "RAY_XDS_{}",
            self.flag.replace('-', "_").to_ascii_uppercase()
        )
    }

    /// `section.name`, as errors and docs/configuration.md name it.
    pub fn path(&self) -> String {
        format!("{}.{}", self.section, self.name)
    }
}

/// Every setting of every policy, in the reference's order.
pub fn all_fields() -> impl Iterator<Item = &'static Field> {
    probe::ProbePolicy::FIELDS
        .iter()
        .chain(dashboard::DashboardPolicy::FIELDS)
        .chain(traffic::TrafficPolicy::FIELDS)
        .chain(switchover::SwitchoverPolicy::FIELDS)
}

/// The global policies: defaults, then `ray-xds.yaml`, then flags and environment.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Policies {
    pub probe: probe::ProbePolicy,
    pub dashboard: dashboard::DashboardPolicy,
    pub traffic: traffic::TrafficPolicy,
    pub switchover: switchover::SwitchoverPolicy,
}

/// Global overrides of every policy: the sections of `ray-xds.yaml`, or the flags.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GlobalOverrides {
    pub probe: probe::GlobalProbe,
    pub dashboard: dashboard::GlobalDashboard,
    pub traffic: traffic::GlobalTraffic,
    pub switchover: switchover::GlobalSwitchover,
}

impl GlobalOverrides {
    /// Sets the setting whose flag is `flag`; `Ok(false)` when no setting has that flag.
    pub(crate) fn set_flag(&mut self, flag: &str, text: &str) -> Result<bool, String> {
        Ok(self.probe.set_flag(flag, text)?
            || self.dashboard.set_flag(flag, text)?
            || self.traffic.set_flag(flag, text)?
            || self.switchover.set_flag(flag, text)?)
    }

    pub fn validate(&self) -> Result<(), String> {
        self.probe.validate()?;
        self.dashboard.validate()?;
        self.traffic.validate()?;
        self.switchover.validate()
    }

    /// `other`'s values where it sets one, else this one's.
    pub(crate) fn or(self, other: GlobalOverrides) -> GlobalOverrides {
        GlobalOverrides {
            probe: self.probe.or(other.probe),
            dashboard: self.dashboard.or(other.dashboard),
            traffic: self.traffic.or(other.traffic),
            switchover: self.switchover.or(other.switchover),
        }
    }
}

impl Policies {
    /// The defaults with `o` (validated) applied.
    pub(crate) fn with_global(&self, o: &GlobalOverrides) -> Policies {
        Policies {
            probe: self.probe.with_global(&o.probe),
            dashboard: self.dashboard.with_global(&o.dashboard),
            traffic: self.traffic.with_global(&o.traffic),
            switchover: self.switchover.with_global(&o.switchover),
        }
    }
}

/// Everything one RayService overrides: `probe:`, `traffic:` and `switchover:` in
/// services.yaml, or `ray-xds.io/*` annotations.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceOverrides {
    #[serde(default)]
    pub probe: probe::ProbeOverrides,
    #[serde(default)]
    pub traffic: traffic::TrafficOverrides,
    #[serde(default)]
    pub switchover: switchover::SwitchoverOverrides,
}

impl ServiceOverrides {
    pub fn validate(&self) -> Result<(), String> {
        self.probe.validate()?;
        self.traffic.validate()?;
        self.switchover.validate()
    }

    /// Sets the setting whose annotation is `name` (without the prefix), checked alone:
    /// a bad value changes nothing. `Ok(false)` when no setting has that annotation.
    pub(crate) fn set_annotation(&mut self, name: &str, text: &str) -> Result<bool, String> {
        let mut one = ServiceOverrides::default();
        let known = one.probe.set_annotation(name, text)?
            || one.traffic.set_annotation(name, text)?
            || one.switchover.set_annotation(name, text)?;
        if !known {
            return Ok(false);
        }
        one.validate()?;
        self.probe.set_annotation(name, text)?;
        self.traffic.set_annotation(name, text)?;
        self.switchover.set_annotation(name, text)?;
        Ok(true)
    }
}

/// Cross-field rules of an override set, beyond each field's own range.
pub(crate) trait CheckOverrides {
    fn check(&self) -> Result<(), String> {
        Ok(())
    }
}

/// Declares a policy: the typed struct with every setting, its per-RayService overrides
/// (`Option` of each [`Scope::Service`] setting) and its global overrides (`Option` of
/// every setting), with the checks, merges, flags and documentation of each.
///
/// ```text
/// declare_policy! {
///     section "traffic";
///     /// doc of the policy
///     pub struct TrafficPolicy, service TrafficOverrides, global GlobalTraffic {
///         service {
///             /// First sentence is the documentation.
///             retries: u32 = 3, range(0, 10), flag "retries";
///         }
///         global {
///             max_concurrent: usize = 256, range(1, 65_536), flag "probe-max-concurrent";
///         }
///     }
/// }
/// ```
#[macro_export]
macro_rules! declare_policy {
    (
        section $section:literal;
        $(#[doc = $doc:literal])*
        pub(crate) struct $policy:ident, service $overrides:ident, global $global:ident {
            service {
                $(
                    $(#[doc = $sdoc:literal])+
                    $sname:ident : $sty:ty = $sdefault:expr,
                        $(range($slo:expr, $shi:expr),)?
                        flag $sflag:literal;
                )*
            }
            global {
                $(
                    $(#[doc = $gdoc:literal])+
                    $gname:ident : $gty:ty = $gdefault:expr,
                        $(range($glo:expr, $ghi:expr),)?
                        flag $gflag:literal;
                )*
            }
        }
    ) => {
        $(#[doc = $doc])*
        #[derive(Clone, Debug, PartialEq, Eq)]
        pub struct $policy {
            $( $(#[doc = $sdoc])+ pub $sname: $sty, )*
            $( $(#[doc = $gdoc])+ pub $gname: $gty, )*
        }

        impl Default for $policy {
            fn default() -> Self {
                $policy {
                    $( $sname: $sdefault, )*
                    $( $gname: $gdefault, )*
                }
            }
        }

        #[doc = concat!("What one RayService overrides of [`", stringify!($policy), "`] (`", $section, ":` in services.yaml, or annotations); `None` keeps the global value.")]
        #[derive(Clone, Debug, Default, PartialEq, Eq, serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct $overrides {
            $(
                #[serde(default, deserialize_with = "crate::policy::deserialize_some")]
                pub $sname: Option<$sty>,
            )*
        }

        #[doc = concat!("The `", $section, ":` section of `ray-xds.yaml` and the flags: every field of [`", stringify!($policy), "`], each optional.")]
        #[derive(Clone, Debug, Default, PartialEq, Eq, serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct $global {
            $(
                #[serde(default, deserialize_with = "crate::policy::deserialize_some")]
                pub $sname: Option<$sty>,
            )*
            $(
                #[serde(default, deserialize_with = "crate::policy::deserialize_some")]
                pub $gname: Option<$gty>,
            )*
        }

        impl $policy {
            /// Every setting of this policy, for docs/configuration.md and `--help`.
            pub(crate) const FIELDS: &'static [$crate::policy::Field] = &[
                $(
                    $crate::policy::Field {
                        section: $section,
                        name: stringify!($sname),
                        flag: $sflag,
                        annotation: Some($sflag),
                        scope: $crate::policy::Scope::Service,
                        doc: $crate::policy::first_sentence(concat!($($sdoc),+)),
                        default: || <$sty as $crate::policy::Value>::show(&$sdefault),
                        range: || $crate::declare_policy!(@range $sty $(, $slo, $shi)?),
                    },
                )*
                $(
                    $crate::policy::Field {
                        section: $section,
                        name: stringify!($gname),
                        flag: $gflag,
                        annotation: None,
                        scope: $crate::policy::Scope::Global,
                        doc: $crate::policy::first_sentence(concat!($($gdoc),+)),
                        default: || <$gty as $crate::policy::Value>::show(&$gdefault),
                        range: || $crate::declare_policy!(@range $gty $(, $glo, $ghi)?),
                    },
                )*
            ];

            /// This policy with one RayService's overrides (checked by
            /// `validate`) applied.
            pub fn with(&self, o: &$overrides) -> Self {
                let mut out = self.clone();
                $( if let Some(v) = &o.$sname { out.$sname = v.clone(); } )*
                <Self as $crate::policy::AfterOverride<$overrides>>::after_override(&mut out, o);
                out
            }

            /// Every field of this policy as a global override set.
            pub fn as_global(&self) -> $global {
                $global {
                    $( $sname: Some(self.$sname.clone()), )*
                    $( $gname: Some(self.$gname.clone()), )*
                }
            }

            /// This policy with global overrides (checked by `validate`) applied.
            pub(crate) fn with_global(&self, o: &$global) -> Self {
                let mut out = self.clone();
                $( if let Some(v) = &o.$sname { out.$sname = v.clone(); } )*
                $( if let Some(v) = &o.$gname { out.$gname = v.clone(); } )*
                <Self as $crate::policy::AfterOverride<$overrides>>::after_override(&mut out, &o.service_part());
                out
            }
        }

        impl $overrides {
            /// Checks every value set against its range, and the cross-field rules; the
            /// error names the field and the allowed values.
            pub fn validate(&self) -> Result<(), String> {
                $(
                    if let Some(v) = &self.$sname {
                        $crate::declare_policy!(@check $section, $sname, $sty, v $(, $slo, $shi)?);
                        <$sty as $crate::policy::Value>::check(v)
                            .map_err(|e| format!("{}.{}: {e}", $section, stringify!($sname)))?;
                    }
                )*
                $crate::policy::CheckOverrides::check(self)
            }

            /// Sets one field from its annotation name (without the prefix) and text.
            #[allow(unused_variables)]
            #[allow(dead_code, reason = "generated for every override type; not every type's is read from annotations")]
            pub(crate) fn set_annotation(&mut self, annotation: &str, text: &str) -> Result<bool, String> {
                match annotation {
                    $(
                        $sflag => {
                            self.$sname = Some(<$sty as $crate::policy::Value>::parse(text)?);
                            Ok(true)
                        }
                    )*
                    _ => Ok(false),
                }
            }

            /// True when nothing is overridden.
            #[allow(dead_code, reason = "generated for every override type; not every type's is called")]
            pub(crate) fn is_empty(&self) -> bool {
                *self == Self::default()
            }
        }

        impl $global {
            /// Checks every value set against its range (see [`$overrides::validate`]).
            pub fn validate(&self) -> Result<(), String> {
                self.service_part().validate()?;
                $(
                    if let Some(v) = &self.$gname {
                        $crate::declare_policy!(@check $section, $gname, $gty, v $(, $glo, $ghi)?);
                        <$gty as $crate::policy::Value>::check(v)
                            .map_err(|e| format!("{}.{}: {e}", $section, stringify!($gname)))?;
                    }
                )*
                Ok(())
            }

            /// The fields a RayService could also override.
            pub(crate) fn service_part(&self) -> $overrides {
                $overrides { $( $sname: self.$sname.clone(), )* }
            }

            /// Sets one field from its flag name (without dashes) and text; `Ok(false)`
            /// when the flag is not one of this policy's.
            pub(crate) fn set_flag(&mut self, flag: &str, text: &str) -> Result<bool, String> {
                match flag {
                    $( $sflag => { self.$sname = Some(<$sty as $crate::policy::Value>::parse(text)?); Ok(true) } )*
                    $( $gflag => { self.$gname = Some(<$gty as $crate::policy::Value>::parse(text)?); Ok(true) } )*
                    _ => Ok(false),
                }
            }

            /// `other`'s values where it sets one, else this one's (flags over the file).
            pub(crate) fn or(self, other: $global) -> Self {
                $global {
                    $( $sname: other.$sname.or(self.$sname), )*
                    $( $gname: other.$gname.or(self.$gname), )*
                }
            }
        }
    };
    (@range $ty:ty) => { <$ty as $crate::policy::Value>::domain() };
    (@range $ty:ty, $lo:expr, $hi:expr) => {{
        let (lo, hi): ($ty, $ty) = ($lo, $hi);
        format!("{}..={}", <$ty as $crate::policy::Value>::show(&lo), <$ty as $crate::policy::Value>::show(&hi))
    }};
    (@check $section:literal, $name:ident, $ty:ty, $v:ident) => {};
    (@check $section:literal, $name:ident, $ty:ty, $v:ident, $lo:expr, $hi:expr) => {
        let (lo, hi): ($ty, $ty) = ($lo, $hi);
        if *$v < lo || *$v > hi {
            return Err(format!(
                "{}.{}: {} is out of range {}..={}",
                $section,
                stringify!($name),
                <$ty as $crate::policy::Value>::show($v),
                <$ty as $crate::policy::Value>::show(&lo),
                <$ty as $crate::policy::Value>::show(&hi),
            ));
        }
    };
}

/// A policy-specific step after overrides apply (e.g. steps imply a progressive shift).
pub(crate) trait AfterOverride<O> {
    fn after_override(&mut self, _overrides: &O) {}
}

/// The first sentence of a doc comment, on one line.
pub(crate) const fn first_sentence(doc: &'static str) -> &'static str {
    // Trimmed at the first ". " or the end; `const` so that it can sit in `FIELDS`.
    let bytes = doc.as_bytes();
    let mut start = 0;
    while start < bytes.len() && bytes[start] == b' ' {
        start += 1;
    }
    let mut end = start;
    while end < bytes.len() {
        if bytes[end] == b'.' && (end + 1 == bytes.len() || bytes[end + 1] == b' ') {
            end += 1;
            break;
        }
        end += 1;
    }
    let (_, rest) = bytes.split_at(start);
    let (sentence, _) = rest.split_at(end - start);
    match std::str::from_utf8(sentence) {
        Ok(s) => s,
        Err(_) => doc,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_field_has_a_unique_flag_and_annotation_and_a_default_in_range() {
        let mut flags = std::collections::BTreeSet::new();
        let mut annotations = std::collections::BTreeSet::new();
        for f in all_fields() {
            assert!(flags.insert(f.flag), "flag {} twice", f.flag);
            if let Some(a) = f.annotation {
                assert!(annotations.insert(a), "annotation {a} twice");
            }
            assert!(
                !f.doc.is_empty() && f.doc.ends_with('.'),
                "{}: {:?}",
                f.path(),
                f.doc
            );
            assert!(!(f.default)().is_empty());
        }
        // Each default, written as docs/configuration.md shows it, reads back and passes its own
        // checks.
        for f in all_fields() {
            let mut one = GlobalOverrides::default();
            let default = (f.default)();
            assert!(
                one.set_flag(f.flag, default.trim_matches(['[', ']']))
                    .unwrap(),
                "{}",
                f.flag
            );
            one.validate()
                .unwrap_or_else(|e| panic!("{}: {e}", f.path()));
        }
        assert_eq!(
            Policies::default().with_global(&GlobalOverrides::default()),
            Policies::default()
        );
    }

    #[test]
    fn first_sentence_stops_at_the_first_full_stop() {
        assert_eq!(first_sentence(" Retries of it. More."), "Retries of it.");
        assert_eq!(first_sentence(" In 1.5 s. More."), "In 1.5 s.");
        assert_eq!(first_sentence("No stop"), "No stop");
    }
}
