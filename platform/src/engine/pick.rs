//! How a step's logits rows become tokens: a device argmax, a draw on the device, or the row
//! copied to the host and sampled there.

use loraplex_kernels::{Backend, RowLogprobs};

use super::EngineError;
use super::sequence::{Sequence, TokenEvent};
use crate::grammar::GrammarError;

/// How this step's token is chosen for a sequence whose tokens are all computed.
#[derive(Clone, Copy)]
pub(super) enum Pick<'a> {
    /// The device's argmax of its logits row, with the logprobs the device gave when asked.
    Argmax(u32, Option<&'a RowLogprobs>),
    /// A token the device drew from its logits row, with the logprobs the device gave when asked.
    Drawn(u32, Option<&'a RowLogprobs>),
    /// Its logits row, sampled on the host.
    Logits(&'a [f32]),
}

/// How one logits row becomes a token.
pub(super) enum Way {
    /// The device's argmax; with `Some(n)`, the device also gives the token's logprob and the
    /// row's `n` most likely tokens.
    Argmax(Option<usize>),
    /// Drawn on the device with these settings (and logprobs as for `Argmax`).
    Device(loraplex_kernels::SampleParams, Option<usize>),
    /// The row copied to the host and sampled there.
    Host,
}

impl Way {
    /// The alternatives the device gives logprobs for, when it gives them.
    fn logprobs(&self) -> Option<usize> {
        match self {
            Way::Argmax(n) | Way::Device(_, n) => *n,
            Way::Host => None,
        }
    }
}

/// What the rows' [`Way`]s fetched from the device.
pub(super) struct Fetched {
    /// Every row's argmax (empty when no row wants one).
    argmax: Vec<u32>,
    /// The device-drawn rows' tokens, in row order.
    drawn: Vec<u32>,
    /// The host rows' logits, `vocab` values each, in row order.
    copied: Vec<f32>,
    /// The logprobs of the rows whose way asks the device for them, in row order.
    logprobs: Vec<RowLogprobs>,
}

impl Fetched {
    /// Each row's [`Pick`], in row order.
    pub(super) fn picks<'a>(&'a self, ways: &[Way], vocab: usize) -> Vec<Pick<'a>> {
        let (mut drawn, mut copied, mut logprobs) = (self.drawn.iter(), self.copied.chunks_exact(vocab.max(1)), self.logprobs.iter());
        ways.iter()
            .enumerate()
            .map(|(i, w)| {
                let lp = if w.logprobs().is_some() { logprobs.next() } else { None };
                match w {
                    Way::Argmax(_) => Pick::Argmax(self.argmax[i], lp),
                    Way::Device(..) => Pick::Drawn(drawn.next().copied().unwrap_or_default(), lp),
                    Way::Host => Pick::Logits(copied.next().unwrap_or_default()),
                }
            })
            .collect()
    }
}

/// What each row's way needs from the device: the argmax rows' ids from one device argmax, the
/// device-drawn rows' ids from one `sample_rows` over those rows gathered, the logprobs asked
/// of those rows from one `row_logprobs` over them gathered, the host rows' logits in one copy
/// (of those rows gathered, unless every row is one).
pub(super) fn fetch_rows<B: Backend>(backend: &B, logits: &B::Buffer, vocab: usize, ways: &[Way]) -> Result<Fetched, EngineError> {
    let n = ways.len();
    let of = |keep: fn(&Way) -> bool| -> Vec<u32> { ways.iter().enumerate().filter(|(_, w)| keep(w)).map(|(i, _)| i as u32).collect() };
    let (argmax_rows, device_rows, host_rows) = (of(|w| matches!(w, Way::Argmax(_))), of(|w| matches!(w, Way::Device(..))), of(|w| matches!(w, Way::Host)));
    let logprob_rows = of(|w| w.logprobs().is_some());
    let check = |got: usize, expected: usize| if got == expected { Ok(()) } else { Err(EngineError::DeviceOutput { expected, got }) };
    // The rows `rows` of `logits` (all of it when they are every row).
    let gather = |rows: &[u32]| -> Result<Option<B::Buffer>, EngineError> {
        if rows.len() == n {
            return Ok(None);
        }
        let idx = backend.upload_u32(rows)?;
        let mut out = backend.zeros_f32(rows.len() * vocab)?;
        backend.gather_rows(logits, &idx, &mut out, vocab)?;
        Ok(Some(out))
    };
    let argmax = if argmax_rows.is_empty() {
        Vec::new()
    } else {
        // One argmax over every row costs next to nothing beside gathering the few.
        let all = backend.argmax_rows(logits, vocab)?;
        check(all.len(), n)?;
        all
    };
    let drawn = if device_rows.is_empty() {
        Vec::new()
    } else {
        let params: Vec<_> = ways.iter().filter_map(|w| if let Way::Device(p, _) = w { Some(*p) } else { None }).collect();
        let some = gather(&device_rows)?;
        let drawn = backend.sample_rows(some.as_ref().unwrap_or(logits), vocab, &params)?;
        check(drawn.len(), device_rows.len())?;
        drawn
    };
    let logprobs = if logprob_rows.is_empty() {
        Vec::new()
    } else {
        // Each row's chosen token; one call for the most alternatives any row asked, each row
        // keeping its own number.
        let mut drawn_at = drawn.iter();
        let mut tokens = Vec::with_capacity(logprob_rows.len());
        let mut wanted = Vec::with_capacity(logprob_rows.len());
        for (i, w) in ways.iter().enumerate() {
            let token = match w {
                Way::Argmax(_) => argmax[i],
                Way::Device(..) => drawn_at.next().copied().unwrap_or_default(),
                Way::Host => continue,
            };
            if let Some(k) = w.logprobs() {
                tokens.push(token);
                wanted.push(k);
            }
        }
        let most = wanted.iter().copied().max().unwrap_or(0);
        let some = gather(&logprob_rows)?;
        let mut got = backend.row_logprobs(some.as_ref().unwrap_or(logits), vocab, &tokens, most)?;
        check(got.len(), logprob_rows.len())?;
        for (row, k) in got.iter_mut().zip(wanted) {
            row.top.truncate(k);
        }
        got
    };
    let copied = if host_rows.is_empty() {
        Vec::new()
    } else {
        let some = gather(&host_rows)?;
        let copied = backend.download_f32(some.as_ref().unwrap_or(logits))?;
        check(copied.len(), host_rows.len() * vocab)?;
        copied
    };
    Ok(Fetched { argmax, drawn, copied, logprobs })
}

/// The next token of `s` and of each of its samples whose prompt is computed; the first event
/// is `s`'s.
pub(super) fn take_tokens(s: &mut Sequence, samples: &mut [Sequence], pick: Pick<'_>) -> Result<Vec<TokenEvent>, GrammarError> {
    let take = |seq: &mut Sequence| match pick {
        Pick::Argmax(token, logprobs) => Ok(seq.take_argmax(token, logprobs)),
        // Only a sequence without samples is drawn on the device (each sample draws its own).
        Pick::Drawn(token, logprobs) => Ok(seq.take_device_draw(token, logprobs)),
        Pick::Logits(row) => seq.sample(&mut row.to_vec()),
    };
    let mut out = vec![take(s)?];
    for c in samples.iter_mut().filter(|c| c.computed == c.tokens.len()) {
        out.push(take(c)?);
    }
    Ok(out)
}
