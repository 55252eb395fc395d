//! Python behaviour that chat templates rely on and minijinja does not have by itself: how
//! jinja2 prints values (through Python's `str`), transformers' `tojson` (Python's
//! `json.dumps`), and `strftime_now`.

use std::fmt::Write as _;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Output, State, Value};

/// Prints values the way jinja2 does (through Python's `str`): `None`, `True`, `False`, and
/// lists/dicts in `repr` form. Everything else uses minijinja's default (auto-escape is off).
pub(crate) fn python_formatter(out: &mut Output<'_>, state: &State<'_, '_>, value: &Value) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None | ValueKind::Bool | ValueKind::Seq | ValueKind::Map => {
            let mut text = String::new();
            python_repr(value, &mut text)?;
            out.write_str(&text).map_err(|e| Error::new(ErrorKind::WriteFailure, e.to_string()))
        }
        _ => minijinja::escape_formatter(out, state, value),
    }
}

fn python_repr(value: &Value, out: &mut String) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None | ValueKind::Undefined => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => push_number(value, out, false)?,
        ValueKind::String => push_py_str_repr(value.as_str().unwrap_or_default(), out),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, item) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(&item, out)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(&key, out)?;
                out.push_str(": ");
                python_repr(&value.get_item(&key)?, out)?;
            }
            out.push('}');
        }
        _ => out.push_str(&value.to_string()),
    }
    Ok(())
}

/// Python's `repr(str)`: single quotes unless the text has a single quote and no double quote.
fn push_py_str_repr(s: &str, out: &mut String) {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || (0x7f..0xa0).contains(&(c as u32)) => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Writes a number as Python does; `json` selects `json.dumps` spellings of NaN and infinity.
fn push_number(value: &Value, out: &mut String, json: bool) -> Result<(), Error> {
    if value.is_integer() {
        let _ = write!(out, "{value}");
        return Ok(());
    }
    let x = f64::try_from(value.clone())?;
    if x.is_nan() {
        out.push_str(if json { "NaN" } else { "nan" });
    } else if x.is_infinite() {
        let sign = if x < 0.0 { "-" } else { "" };
        let _ = write!(out, "{sign}{}", if json { "Infinity" } else { "inf" });
    } else {
        // Rust's `{:?}` picks the same shortest round-trip digits and the same switch to
        // exponent notation (below 1e-4, from 1e16 on) as Python's float repr; only the
        // exponent is spelled differently (`1e16` vs `1e+16`, `1e-5` vs `1e-05`).
        let text = format!("{x:?}");
        match text.split_once('e') {
            Some((mantissa, exp)) => {
                let (sign, digits) = exp.strip_prefix('-').map_or(("+", exp), |d| ("-", d));
                let _ = write!(out, "{mantissa}e{sign}{digits:0>2}");
            }
            None => out.push_str(&text),
        }
    }
    Ok(())
}

/// Options of Python's `json.dumps` that `tojson` exposes.
struct JsonStyle {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, so no HTML escaping, Python's separators (`", "`,
/// `": "`) and optional indentation.
pub(crate) fn tojson_filter(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match kwargs.get::<Option<Value>>("indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.is_integer() => {
            let n = v.as_i64().unwrap_or(0).clamp(0, 64);
            Some(" ".repeat(usize::try_from(n).unwrap_or(0)))
        }
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or_default().to_owned()),
        Some(_) => {
            return Err(Error::new(ErrorKind::InvalidOperation, "tojson: indent must be an int or a string"));
        }
    };
    let (item_sep, key_sep) = match kwargs.get::<Option<Vec<String>>>("separators")? {
        Some(seps) => match <[String; 2]>::try_from(seps) {
            Ok([item, key]) => (item, key),
            Err(_) => {
                return Err(Error::new(ErrorKind::InvalidOperation, "tojson: separators must be a pair"));
            }
        },
        None if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    let style = JsonStyle {
        indent,
        item_sep,
        key_sep,
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(value, &style, 0, &mut out)?;
    Ok(Value::from(out))
}

fn newline_indent(style: &JsonStyle, level: usize, out: &mut String) {
    if let Some(indent) = &style.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(indent);
        }
    }
}

fn write_json(value: &Value, style: &JsonStyle, level: usize, out: &mut String) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => push_number(value, out, true)?,
        ValueKind::String => push_json_str(value.as_str().unwrap_or_default(), style.ensure_ascii, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline_indent(style, level + 1, out);
                write_json(item, style, level + 1, out)?;
            }
            newline_indent(style, level, out);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((json_key(&key)?, item));
            }
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (key, item)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline_indent(style, level + 1, out);
                push_json_str(key, style.ensure_ascii, out);
                out.push_str(&style.key_sep);
                write_json(item, style, level + 1, out)?;
            }
            newline_indent(style, level, out);
            out.push('}');
        }
        kind => {
            return Err(Error::new(ErrorKind::InvalidOperation, format!("tojson: a value of type {kind} is not JSON serializable")));
        }
    }
    Ok(())
}

/// Dict keys as `json.dumps` writes them: strings as they are, other scalars converted.
fn json_key(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_owned()),
        ValueKind::None => Ok("null".to_owned()),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.to_owned()),
        ValueKind::Number => {
            let mut s = String::new();
            push_number(key, &mut s, true)?;
            Ok(s)
        }
        kind => Err(Error::new(ErrorKind::InvalidOperation, format!("tojson: keys must be str, not {kind}"))),
    }
}

fn push_json_str(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) > 0x7e) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

// ---------------------------------------------------------------------------------------------
// strftime_now

const MONTHS: [&str; 12] = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November", "December"];
const WEEKDAYS: [&str; 7] = ["Sunday", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"];

/// A UTC calendar time broken into fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CivilTime {
    year: i64,
    month: u32, // 1..=12
    day: u32,   // 1..=31
    hour: u32,
    minute: u32,
    second: u32,
    weekday: usize, // 0 = Sunday
    yday: u32,      // 1..=366
}

impl CivilTime {
    fn from_unix(secs: i64) -> Self {
        let days = secs.div_euclid(86_400);
        let rem = secs.rem_euclid(86_400);
        // Days-to-civil conversion for the proleptic Gregorian calendar (eras of 400 years).
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z.rem_euclid(146_097);
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
        let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
        let year = yoe + era * 400 + i64::from(month <= 2);
        let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
        const CUMULATIVE: [u32; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
        let yday = CUMULATIVE[(month - 1) as usize] + day + u32::from(leap && month > 2);
        CivilTime {
            year,
            month,
            day,
            hour: (rem / 3600) as u32,
            minute: (rem % 3600 / 60) as u32,
            second: (rem % 60) as u32,
            weekday: (days + 4).rem_euclid(7) as usize,
            yday,
        }
    }
}

/// `strftime` for the directives chat templates use, including glibc's `%-d` (no padding).
/// Unknown directives are copied through, as glibc does.
fn format_strftime(fmt: &str, t: &CivilTime) -> String {
    let mut out = String::new();
    let mut chars = fmt.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let no_pad = chars.peek() == Some(&'-');
        if no_pad {
            chars.next();
        }
        let Some(d) = chars.next() else {
            out.push('%');
            break;
        };
        let num = |out: &mut String, v: u32, width: usize| {
            if no_pad {
                let _ = write!(out, "{v}");
            } else {
                let _ = write!(out, "{v:0width$}");
            }
        };
        let month = MONTHS[(t.month - 1) as usize];
        let weekday = WEEKDAYS[t.weekday];
        let hour12 = if t.hour.is_multiple_of(12) { 12 } else { t.hour % 12 };
        match d {
            'Y' => {
                let _ = write!(out, "{}", t.year);
            }
            'y' => num(&mut out, t.year.rem_euclid(100) as u32, 2),
            'm' => num(&mut out, t.month, 2),
            'd' => num(&mut out, t.day, 2),
            'e' => {
                let _ = if no_pad { write!(out, "{}", t.day) } else { write!(out, "{:>2}", t.day) };
            }
            'H' => num(&mut out, t.hour, 2),
            'I' => num(&mut out, hour12, 2),
            'M' => num(&mut out, t.minute, 2),
            'S' => num(&mut out, t.second, 2),
            'j' => num(&mut out, t.yday, 3),
            'p' => out.push_str(if t.hour < 12 { "AM" } else { "PM" }),
            'B' => out.push_str(month),
            'b' | 'h' => out.push_str(&month[..3]),
            'A' => out.push_str(weekday),
            'a' => out.push_str(&weekday[..3]),
            'Z' => out.push_str("UTC"),
            'z' => out.push_str("+0000"),
            'F' => {
                let _ = write!(out, "{}-{:02}-{:02}", t.year, t.month, t.day);
            }
            'T' => {
                let _ = write!(out, "{:02}:{:02}:{:02}", t.hour, t.minute, t.second);
            }
            '%' => out.push('%'),
            other => {
                out.push('%');
                if no_pad {
                    out.push('-');
                }
                out.push(other);
            }
        }
    }
    out
}

/// `strftime_now(fmt)`: the current time (UTC) formatted like Python's `strftime`.
pub(crate) fn strftime_now(fmt: &str) -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(0));
    format_strftime(fmt, &CivilTime::from_unix(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-07-26 13:05:09 UTC, a Friday.
        let t = CivilTime::from_unix(1_721_999_109);
        assert_eq!(t, CivilTime { year: 2024, month: 7, day: 26, hour: 13, minute: 5, second: 9, weekday: 5, yday: 208 });
        assert_eq!(format_strftime("%d %b %Y", &t), "26 Jul 2024");
        assert_eq!(format_strftime("%A, %B %-d, %Y %I:%M:%S %p %j %% %q", &t), "Friday, July 26, 2024 01:05:09 PM 208 % %q");
        assert_eq!(format_strftime("%F %T %y %e", &CivilTime::from_unix(0)), "1970-01-01 00:00:00 70  1");
        assert_eq!(CivilTime::from_unix(951_782_400).yday, 60); // 2000-02-29
    }
}
