//! Files of requests, one JSON object a line (OpenAI's batch input format): reading them line by
//! line within bounds, checking every line when a file is uploaded, and what a batch needs to
//! know of a file before it starts. Everything here does file I/O: it runs on the background
//! pool.

use std::collections::{BTreeMap, HashSet};
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use serde::Deserialize;
use serde_json::value::RawValue;

use super::super::error::LineError;
use super::super::openai::BatchEndpoint;
use crate::grammar::GrammarLimits;

/// Longest line (one request), as the longest JSON body the API accepts.
pub const MAX_LINE_BYTES: usize = super::super::MAX_JSON_BYTES;

/// Most requests in one file (OpenAI's bound).
pub const MAX_LINES: u64 = 50_000;

/// Longest `custom_id`.
pub const MAX_CUSTOM_ID_BYTES: usize = 512;

/// Most distinct models (the base model and adapters) one batch may name.
pub const MAX_MODELS: usize = 256;

/// Invalid lines a refusal lists (all of them are counted).
pub const MAX_REPORTED: usize = 100;

/// One line of a file of requests.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestLine {
    pub custom_id: String,
    pub method: String,
    pub url: String,
    pub body: Box<RawValue>,
}

impl RequestLine {
    /// Parses a line and checks its envelope (method, URL, `custom_id`); the body is checked by
    /// its endpoint.
    pub fn parse(text: &str) -> Result<(Self, BatchEndpoint), (Option<String>, String)> {
        let line: RequestLine = serde_json::from_str(text).map_err(|e| (peek_custom_id(text), format!("not a request line: {e}")))?;
        let id = Some(line.custom_id.clone());
        if line.custom_id.is_empty() || line.custom_id.len() > MAX_CUSTOM_ID_BYTES {
            return Err((None, format!("`custom_id` must have 1 to {MAX_CUSTOM_ID_BYTES} bytes")));
        }
        if line.method != "POST" {
            return Err((id, format!("`method` must be POST, not {:?}", short(&line.method))));
        }
        let Some(endpoint) = BatchEndpoint::from_url(&line.url) else {
            let known: Vec<&str> = BatchEndpoint::ALL.iter().map(|e| e.url()).collect();
            return Err((id, format!("`url` {:?} is not one a batch can call: use {}", short(&line.url), known.join(" or "))));
        };
        Ok((line, endpoint))
    }
}

/// The `custom_id` of a line that did not parse, where one can be read.
fn peek_custom_id(text: &str) -> Option<String> {
    #[derive(Deserialize)]
    struct Id {
        custom_id: String,
    }
    serde_json::from_str::<Id>(text).ok().map(|i| i.custom_id).filter(|c| c.len() <= MAX_CUSTOM_ID_BYTES)
}

fn short(s: &str) -> String {
    s.chars().take(64).collect()
}

/// A line as read: its text, or why it cannot be one.
pub type Line = Result<String, String>;

/// Reads a file line by line: lines end at `\n` (a `\r` before it is dropped), blank lines are
/// skipped, and a line longer than [`MAX_LINE_BYTES`] is read past without being held.
pub struct LineReader<R> {
    reader: BufReader<R>,
    /// The next line's number, from 0.
    next: u64,
}

impl LineReader<std::fs::File> {
    pub fn open(path: &Path) -> std::io::Result<Self> {
        Ok(Self::new(std::fs::File::open(path)?))
    }
}

impl<R: Read> LineReader<R> {
    pub fn new(reader: R) -> Self {
        Self { reader: BufReader::with_capacity(1 << 16, reader), next: 0 }
    }

    /// The next line that is not blank, with its number (from 0); `None` at the end.
    pub fn next_line(&mut self) -> std::io::Result<Option<(u64, Line)>> {
        let mut buf = Vec::new();
        loop {
            buf.clear();
            let limit = MAX_LINE_BYTES as u64 + 1;
            let n = self.reader.by_ref().take(limit).read_until(b'\n', &mut buf)?;
            if n == 0 {
                return Ok(None);
            }
            let number = self.next;
            self.next += 1;
            if buf.last() != Some(&b'\n') && buf.len() as u64 == limit {
                self.skip_rest()?;
                return Ok(Some((number, Err(format!("the line is longer than {MAX_LINE_BYTES} bytes")))));
            }
            while matches!(buf.last(), Some(b'\n' | b'\r')) {
                buf.pop();
            }
            if buf.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let line = String::from_utf8(std::mem::take(&mut buf)).map_err(|_| "the line is not UTF-8".to_string());
            return Ok(Some((number, line)));
        }
    }

    /// Reads to the end of the current line.
    fn skip_rest(&mut self) -> std::io::Result<()> {
        loop {
            let available = self.reader.fill_buf()?;
            if available.is_empty() {
                return Ok(());
            }
            if let Some(at) = available.iter().position(|&b| b == b'\n') {
                self.reader.consume(at + 1);
                return Ok(());
            }
            let n = available.len();
            self.reader.consume(n);
        }
    }
}

/// What checking a file found: the number of requests, or every line's problem.
#[derive(Debug, PartialEq, Eq)]
pub enum Checked {
    Valid { requests: u64 },
    Invalid { count: u64, first: Vec<LineError> },
}

/// Checks every line of an uploaded file as the API would check it as a request: the envelope,
/// a unique `custom_id`, the body as its endpoint parses it, and its constraint on the output
/// (a schema, a grammar, tools) against the size and depth bounds `grammar` sets, as the live
/// route checks it before compiling. What needs the model is checked later: the model's name
/// when the batch is created, the prompt's length when the line runs.
pub fn check<R: Read>(reader: R, grammar: &GrammarLimits) -> std::io::Result<Checked> {
    let mut lines = LineReader::new(reader);
    let (mut requests, mut count, mut first) = (0u64, 0u64, Vec::new());
    let mut ids: HashSet<String> = HashSet::new();
    let mut fail = |number: u64, custom_id: Option<String>, message: String| {
        count += 1;
        if first.len() < MAX_REPORTED {
            first.push(LineError { line: number + 1, custom_id, message });
        }
    };
    while let Some((number, line)) = lines.next_line()? {
        requests += 1;
        if requests == MAX_LINES + 1 {
            fail(number, None, format!("a file may hold at most {MAX_LINES} requests"));
        }
        let text = match line {
            Ok(text) => text,
            Err(why) => {
                fail(number, None, why);
                continue;
            }
        };
        let (line, endpoint) = match RequestLine::parse(&text) {
            Ok(parsed) => parsed,
            Err((id, why)) => {
                fail(number, id, why);
                continue;
            }
        };
        let problem = endpoint.parse(&line.body).and_then(|parsed| parsed.grammar().map_or(Ok(()), |g| super::super::structured::check(g, grammar)));
        if let Err(e) = problem {
            fail(number, Some(line.custom_id.clone()), format!("the body is not a valid {} request: {e}", endpoint.url()));
        }
        if !ids.insert(line.custom_id.clone()) {
            fail(number, Some(line.custom_id), "the `custom_id` is used by an earlier line; each must be unique".into());
        }
    }
    if requests == 0 {
        return Ok(Checked::Invalid { count: 1, first: vec![LineError { line: 1, custom_id: None, message: "the file holds no requests".into() }] });
    }
    Ok(if count == 0 { Checked::Valid { requests } } else { Checked::Invalid { count, first } })
}

/// What a batch needs of its input file before it starts: the models its lines name (each
/// with its first line), and the lines that call another endpoint than the batch's.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Scan {
    pub models: BTreeMap<String, u64>,
    pub problems: Vec<LineError>,
    pub problem_count: u64,
}

/// Reads the URL and model of every line (the file was checked when it was uploaded).
pub fn scan<R: Read>(reader: R, endpoint: BatchEndpoint) -> std::io::Result<Scan> {
    #[derive(Deserialize)]
    struct Peek {
        custom_id: String,
        url: String,
        body: PeekBody,
    }
    #[derive(Deserialize)]
    struct PeekBody {
        model: String,
    }
    let mut lines = LineReader::new(reader);
    let mut scan = Scan::default();
    let problem = |scan: &mut Scan, number: u64, custom_id: Option<String>, message: String| {
        scan.problem_count += 1;
        if scan.problems.len() < MAX_REPORTED {
            scan.problems.push(LineError { line: number + 1, custom_id, message });
        }
    };
    while let Some((number, line)) = lines.next_line()? {
        let peek = line.and_then(|text| serde_json::from_str::<Peek>(&text).map_err(|e| e.to_string()));
        let peek = match peek {
            Ok(p) => p,
            Err(why) => {
                problem(&mut scan, number, None, why);
                continue;
            }
        };
        if peek.url != endpoint.url() {
            let message = format!("the line calls {:?}, the batch {}; a batch calls one endpoint", short(&peek.url), endpoint.url());
            problem(&mut scan, number, Some(peek.custom_id), message);
            continue;
        }
        if !scan.models.contains_key(&peek.body.model) {
            if scan.models.len() == MAX_MODELS {
                problem(&mut scan, number, Some(peek.custom_id), format!("a batch may name at most {MAX_MODELS} models"));
                continue;
            }
            scan.models.insert(peek.body.model, number);
        }
    }
    Ok(scan)
}

#[cfg(test)]
mod tests;
