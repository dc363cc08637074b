//! Label and field selectors, as the real server reads them (`labelSelector`: `=`, `==`,
//! `!=`, `in`, `notin`, exists, not exists; `fieldSelector`: `=`, `==`, `!=` on a dotted
//! path).
//!
//! Invariant: a selector that does not parse is a 400, never a match.

use super::*;

pub(super) fn labels_of(object: &Value) -> Option<&Map<String, Value>> {
    object
        .pointer("/metadata/labels")
        .and_then(Value::as_object)
}

/// One requirement of a label selector.
pub(super) enum Requirement {
    Exists(String),
    NotExists(String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

impl Requirement {
    pub(super) fn parse(text: &str) -> Result<Requirement, String> {
        let invalid = || format!("invalid label selector requirement {text:?}");
        let key = |k: &str| {
            let k = k.trim();
            let ok = !k.is_empty()
                && k.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'));
            ok.then(|| k.to_string()).ok_or_else(invalid)
        };
        let value = |v: &str| {
            let v = v.trim();
            v.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
                .then(|| v.to_string())
                .ok_or_else(invalid)
        };
        let text = text.trim();
        if let Some(k) = text.strip_prefix('!') {
            return Ok(Requirement::NotExists(key(k)?));
        }
        if let Some((head, set)) = text.split_once('(') {
            let set = set.strip_suffix(')').ok_or_else(invalid)?;
            let values = set.split(',').map(value).collect::<Result<Vec<_>, _>>()?;
            return match head.split_whitespace().collect::<Vec<_>>().as_slice() {
                [k, "in"] => Ok(Requirement::In(key(k)?, values)),
                [k, "notin"] => Ok(Requirement::NotIn(key(k)?, values)),
                _ => Err(invalid()),
            };
        }
        if let Some((k, v)) = text.split_once("!=") {
            return Ok(Requirement::NotIn(key(k)?, vec![value(v)?]));
        }
        if let Some((k, v)) = text.split_once("==").or_else(|| text.split_once('=')) {
            return Ok(Requirement::In(key(k)?, vec![value(v)?]));
        }
        Ok(Requirement::Exists(key(text)?))
    }

    pub(super) fn matches(&self, labels: Option<&Map<String, Value>>) -> bool {
        let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        match self {
            Requirement::Exists(k) => get(k).is_some(),
            Requirement::NotExists(k) => get(k).is_none(),
            Requirement::In(k, values) => get(k).is_some_and(|v| values.iter().any(|x| x == v)),
            Requirement::NotIn(k, values) => get(k).is_none_or(|v| values.iter().all(|x| x != v)),
        }
    }
}

/// A label selector: `key`, `!key`, `key=value`, `key==value`, `key!=value`,
/// `key in (a,b)`, `key notin (a,b)`, joined by commas (all must hold).
#[derive(Default)]
pub(super) struct LabelSelector(pub(super) Vec<Requirement>);

impl LabelSelector {
    pub(super) fn parse(text: &str) -> Result<LabelSelector, String> {
        if text.trim().is_empty() {
            return Ok(LabelSelector::default());
        }
        // Split at the commas outside parentheses.
        let (mut parts, mut start, mut depth) = (Vec::new(), 0, 0i32);
        for (i, c) in text.char_indices() {
            match c {
                '(' => depth += 1,
                ')' => depth -= 1,
                ',' if depth == 0 => {
                    parts.push(&text[start..i]);
                    start = i + 1;
                }
                _ => {}
            }
        }
        parts.push(&text[start..]);
        parts
            .into_iter()
            .map(Requirement::parse)
            .collect::<Result<_, _>>()
            .map(LabelSelector)
    }

    pub(super) fn matches(&self, object: &Value) -> bool {
        let labels = labels_of(object);
        self.0.iter().all(|r| r.matches(labels))
    }
}

/// A field selector: `path=value`, `path==value`, `path!=value` joined by commas, where
/// `path` is any dotted path into the object (`metadata.name`, `status.phase`).
#[derive(Default)]
pub(super) struct FieldSelector(pub(super) Vec<(String, bool, String)>);

impl FieldSelector {
    pub(super) fn parse(text: &str) -> Result<FieldSelector, String> {
        if text.trim().is_empty() {
            return Ok(FieldSelector::default());
        }
        text.split(',')
            .map(|part| {
                let (path, equal, value) = if let Some((p, v)) = part.split_once("!=") {
                    (p, false, v)
                } else if let Some((p, v)) = part.split_once("==").or_else(|| part.split_once('='))
                {
                    (p, true, v)
                } else {
                    return Err(format!("invalid field selector requirement {part:?}"));
                };
                let pointer = format!("/{}", path.trim().replace('.', "/"));
                Ok((pointer, equal, value.trim().to_string()))
            })
            .collect::<Result<_, _>>()
            .map(FieldSelector)
    }

    pub(super) fn matches(&self, object: &Value) -> bool {
        self.0.iter().all(|(pointer, equal, expected)| {
            let actual = match object.pointer(pointer) {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(other) => other.to_string(),
            };
            (actual == *expected) == *equal
        })
    }
}
