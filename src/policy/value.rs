//! The kinds of value a setting holds, each read the same way from YAML, a flag, an
//! environment variable or an annotation, and shown the same way in errors and docs/configuration.md.

use std::fmt::Debug;
use std::time::Duration;

use serde::{Deserialize, Deserializer};

/// A setting's type.
pub trait Value: Clone + PartialEq + Debug + Sized {
    /// From the text of a flag, an environment variable or an annotation.
    fn parse(text: &str) -> Result<Self, String>;
    /// From YAML (durations as `500ms`, `10s`; lists as YAML lists).
    fn deserialize_value<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error>;
    /// As a user would write it.
    fn show(&self) -> String;
    /// What the type allows, for settings without a range.
    fn domain() -> String;
    /// Rules of the type itself (a field's range is checked apart).
    fn check(&self) -> Result<(), String> {
        Ok(())
    }
}

/// `deserialize_with` for an optional setting: present means `Some`.
pub fn deserialize_some<'de, D: Deserializer<'de>, T: Value>(d: D) -> Result<Option<T>, D::Error> {
    T::deserialize_value(d).map(Some)
}

macro_rules! whole_number {
    ($($ty:ty),*) => {$(
        impl Value for $ty {
            fn parse(text: &str) -> Result<Self, String> {
                text.trim()
                    .parse()
                    .map_err(|_| format!("{text:?} is not a whole number"))
            }
            fn deserialize_value<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                <$ty>::deserialize(d)
            }
            fn show(&self) -> String {
                self.to_string()
            }
            fn domain() -> String {
                format!("0..={}", <$ty>::MAX)
            }
        }
    )*};
}
whole_number!(u32, usize);

impl Value for bool {
    fn parse(text: &str) -> Result<Self, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "true" => Ok(true),
            "false" => Ok(false),
            _ => Err(format!("{text:?}: expected true or false")),
        }
    }
    fn deserialize_value<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        bool::deserialize(d)
    }
    fn show(&self) -> String {
        self.to_string()
    }
    fn domain() -> String {
        "true, false".into()
    }
}

impl Value for Duration {
    fn parse(text: &str) -> Result<Self, String> {
        humantime::parse_duration(text.trim())
            .map_err(|e| format!("{text:?} is not a duration (500ms, 10s, 1m): {e}"))
    }
    fn deserialize_value<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        humantime_serde::deserialize(d)
    }
    fn show(&self) -> String {
        humantime::format_duration(*self).to_string()
    }
    fn domain() -> String {
        "a duration".into()
    }
    /// Envoy reads most of its durations in whole milliseconds: `1500us` would act as
    /// `1ms`, and `500us` as 0 (no ejection, no back-off), so neither is taken.
    fn check(&self) -> Result<(), String> {
        if !self.subsec_nanos().is_multiple_of(1_000_000) {
            return Err(format!(
                "{} is not a whole number of milliseconds",
                humantime::format_duration(*self)
            ));
        }
        Ok(())
    }
}

/// Progressive switchover steps: percents of traffic on the new cluster, rising from
/// above 0 to 100 (`10,25,50,100`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Steps(pub Vec<u32>);

/// More steps than this is a mistake, not a plan.
pub const MAX_STEPS: usize = 100;

impl Value for Steps {
    fn parse(text: &str) -> Result<Self, String> {
        text.split(',')
            .map(|s| s.trim().parse::<u32>())
            .collect::<Result<Vec<_>, _>>()
            .map(Steps)
            .map_err(|e| format!("{text:?} is not a list of percents: {e}"))
    }
    fn deserialize_value<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Vec::<u32>::deserialize(d).map(Steps)
    }
    fn show(&self) -> String {
        let parts: Vec<String> = self.0.iter().map(u32::to_string).collect();
        format!("[{}]", parts.join(", "))
    }
    fn domain() -> String {
        "percents rising from above 0 to 100".into()
    }
    fn check(&self) -> Result<(), String> {
        let rising = self.0.windows(2).all(|w| w[0] < w[1]);
        if self.0.last() != Some(&100)
            || !rising
            || self.0.first() == Some(&0)
            || self.0.len() > MAX_STEPS
        {
            return Err(format!(
                "steps {:?} must rise from above 0 to 100 (at most {MAX_STEPS} of them)",
                self.0
            ));
        }
        Ok(())
    }
}

/// Implements [`Value`] for a fieldless enum written in lowercase.
#[macro_export]
macro_rules! lowercase_enum_value {
    ($ty:ty { $($variant:ident = $text:literal),+ $(,)? }) => {
        impl $crate::policy::Value for $ty {
            fn parse(text: &str) -> Result<Self, String> {
                match text.trim() {
                    $($text => Ok(<$ty>::$variant),)+
                    _ => Err(format!("{text:?}: expected {}", <$ty as $crate::policy::Value>::domain())),
                }
            }
            fn deserialize_value<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let text = <String as serde::Deserialize>::deserialize(d)?;
                <$ty as $crate::policy::Value>::parse(&text).map_err(serde::de::Error::custom)
            }
            fn show(&self) -> String {
                match self { $(<$ty>::$variant => $text.to_string(),)+ }
            }
            fn domain() -> String {
                [$($text),+].join(", ")
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_and_display_round_trip() {
        for d in ["250ms", "10s", "1m 30s", "0s"] {
            assert_eq!(Duration::parse(d).unwrap().show(), d);
        }
        assert_eq!(u32::parse(" 7 ").unwrap(), 7);
        assert!(u32::parse("-1").is_err());
        assert!(u32::parse("4294967296").is_err());
        assert!(bool::parse("yes").is_err());
        assert!(bool::parse("True").unwrap() && !bool::parse(" FALSE ").unwrap());
        assert_eq!(Steps::parse("10, 50,100").unwrap().show(), "[10, 50, 100]");
    }

    #[test]
    fn steps_rise_to_100() {
        for bad in ["50,90", "0,100", "50,50,100", ""] {
            let steps = Steps::parse(bad);
            assert!(steps.is_err() || steps.unwrap().check().is_err(), "{bad}");
        }
        assert!(Steps(vec![100]).check().is_ok());
        assert!(Steps((1..=101).collect()).check().is_err());
    }

    #[test]
    fn durations_are_whole_milliseconds() {
        assert!(Duration::parse("1500us").unwrap().check().is_err());
        assert!(Duration::parse("500us").unwrap().check().is_err());
        assert!(Duration::parse("1ms").unwrap().check().is_ok());
        assert!(Duration::parse("2s 5ms").unwrap().check().is_ok());
    }
}
