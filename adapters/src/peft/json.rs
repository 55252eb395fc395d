//! A JSON value that keeps object keys in the order the file wrote them.
//!
//! PEFT resolves `rank_pattern`/`alpha_pattern` by the first matching key in the saved order, so
//! the config cannot go through a sorted map. A small value type of our own keeps that order
//! without switching the whole workspace's `serde_json` to `preserve_order`.

use std::collections::HashSet;
use std::fmt;

use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Json {
    Null,
    Bool(bool),
    /// An integer that fits i64 (JSON numbers written without fraction or exponent).
    Int(i64),
    Float(f64),
    Str(String),
    Arr(Vec<Json>),
    /// Key/value pairs in file order.
    Obj(Vec<(String, Json)>),
}

impl Json {
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Json::Null => "null",
            Json::Bool(_) => "a boolean",
            Json::Int(_) | Json::Float(_) => "a number",
            Json::Str(_) => "a string",
            Json::Arr(_) => "a list",
            Json::Obj(_) => "an object",
        }
    }

    /// The value as f64 when it is a number.
    pub(crate) fn as_f64(&self) -> Option<f64> {
        match *self {
            Json::Int(i) => Some(i as f64),
            Json::Float(f) => Some(f),
            _ => None,
        }
    }

    /// The value as a non-negative integer (floats with no fractional part count, as Python
    /// configs sometimes write `8.0`).
    pub(crate) fn as_index(&self) -> Option<u64> {
        match *self {
            Json::Int(i) => u64::try_from(i).ok(),
            Json::Float(f) if f >= 0.0 && f.fract() == 0.0 && f < 9.0e15 => Some(f as u64),
            _ => None,
        }
    }

    /// "Falsy" in the Python sense for the option-like keys we refuse: absent, null, false,
    /// zero, or an empty string/list/object.
    pub(crate) fn is_falsy(&self) -> bool {
        match self {
            Json::Null => true,
            Json::Bool(b) => !b,
            Json::Int(i) => *i == 0,
            Json::Float(f) => *f == 0.0,
            Json::Str(s) => s.is_empty(),
            Json::Arr(a) => a.is_empty(),
            Json::Obj(o) => o.is_empty(),
        }
    }
}

impl<'de> Deserialize<'de> for Json {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(JsonVisitor)
    }
}

struct JsonVisitor;

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = Json;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_unit<E>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }
    fn visit_none<E>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Json, D::Error> {
        Json::deserialize(d)
    }
    fn visit_bool<E>(self, v: bool) -> Result<Json, E> {
        Ok(Json::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Json, E> {
        Ok(Json::Int(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Json, E> {
        Ok(i64::try_from(v).map(Json::Int).unwrap_or(Json::Float(v as f64)))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Json, E> {
        Ok(Json::Float(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<Json, E> {
        Ok(Json::Str(v.to_string()))
    }
    fn visit_string<E>(self, v: String) -> Result<Json, E> {
        Ok(Json::Str(v))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
        let mut out = Vec::new();
        while let Some(v) = seq.next_element::<Json>()? {
            out.push(v);
        }
        Ok(Json::Arr(out))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
        let mut out: Vec<(String, Json)> = Vec::new();
        // A set, not a scan of `out`: an object with many keys must not cost quadratic time.
        let mut seen = HashSet::new();
        while let Some((k, v)) = map.next_entry::<String, Json>()? {
            if !seen.insert(k.clone()) {
                return Err(serde::de::Error::custom(format!("duplicate key `{k}`")));
            }
            out.push((k, v));
        }
        Ok(Json::Obj(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn object_keys_keep_file_order() {
        let j: Json = serde_json::from_str(r#"{"z": 1, "a": 2.5, "m": [true, null, "s"]}"#).unwrap();
        let Json::Obj(pairs) = j else { panic!("not an object") };
        let keys: Vec<&str> = pairs.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["z", "a", "m"]);
        assert_eq!(pairs[1].1, Json::Float(2.5));
        assert_eq!(pairs[2].1, Json::Arr(vec![Json::Bool(true), Json::Null, Json::Str("s".into())]));
    }

    #[test]
    fn duplicate_keys_are_rejected() {
        let r: Result<Json, _> = serde_json::from_str(r#"{"a": 1, "a": 2}"#);
        assert!(r.unwrap_err().to_string().contains("duplicate key `a`"));
    }
}
