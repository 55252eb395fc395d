//! Stop strings over streamed text, with OpenAI semantics: the output ends just before the
//! first stop string to occur, which is itself not part of the output.

/// Watches streamed text for any of a set of stop strings.
///
/// Text is pushed as it is decoded. What cannot be the beginning of a stop string is released
/// at once; a suffix that could still grow into a stop string is held back until the next push
/// decides it (or [`finish`](Self::finish) releases it at the end of the stream).
#[derive(Clone, Debug, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    /// Text received but not yet released: always shorter than the longest stop string, unless
    /// there are no stop strings at all.
    held: String,
    stopped: Option<usize>,
}

/// What one push released.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StopOutcome {
    /// Text that is safe to emit now.
    pub emit: String,
    /// The index (in the list given to [`StopStrings::new`]) of the stop string that ended the
    /// stream, once one has.
    pub stopped: Option<usize>,
}

impl StopStrings {
    /// Empty stop strings are ignored (they keep their index for the others, though).
    pub fn new(stops: Vec<String>) -> Self {
        Self { stops, held: String::new(), stopped: None }
    }

    /// Whether a stop string has matched.
    pub fn stopped(&self) -> Option<usize> {
        self.stopped
    }

    /// Feeds the next piece of text.
    ///
    /// When several stop strings are complete in the text seen so far, the one that starts
    /// earliest wins (the lowest index among those starting at the same place). A stop string
    /// that could still complete at an earlier position does not delay a complete one: the
    /// stream ends as soon as any stop string has occurred. After a stop, pushes release nothing.
    pub fn push(&mut self, new_text: &str) -> StopOutcome {
        if let Some(i) = self.stopped {
            return StopOutcome { emit: String::new(), stopped: Some(i) };
        }
        self.held.push_str(new_text);

        let mut best: Option<(usize, usize)> = None; // (byte position, stop index)
        for (i, stop) in self.stops.iter().enumerate() {
            if stop.is_empty() {
                continue;
            }
            if let Some(pos) = self.held.find(stop.as_str())
                && best.is_none_or(|(b, _)| pos < b)
            {
                best = Some((pos, i));
            }
        }
        if let Some((pos, i)) = best {
            self.held.truncate(pos);
            self.stopped = Some(i);
            return StopOutcome { emit: std::mem::take(&mut self.held), stopped: Some(i) };
        }

        let keep_from = self.partial_match_start();
        let rest = self.held.split_off(keep_from);
        StopOutcome { emit: std::mem::replace(&mut self.held, rest), stopped: None }
    }

    /// Ends the stream: releases what was held back (nothing after a stop).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// The earliest position from which the held text is a proper prefix of some stop string,
    /// or its length if there is none. Everything before it can never be part of a stop.
    fn partial_match_start(&self) -> usize {
        let held = self.held.as_str();
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        // A partial match is shorter than the longest stop string.
        let lowest = held.len().saturating_sub(longest.saturating_sub(1));
        held.char_indices()
            .map(|(i, _)| i)
            .filter(|&i| i >= lowest)
            .find(|&i| {
                let tail = &held[i..];
                self.stops.iter().any(|s| s.len() > tail.len() && s.starts_with(tail))
            })
            .unwrap_or(held.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stops(list: &[&str]) -> StopStrings {
        StopStrings::new(list.iter().map(|s| s.to_string()).collect())
    }

    /// Pushes every piece and returns the concatenated output and the stop index.
    fn run(s: &mut StopStrings, pieces: &[&str]) -> (String, Option<usize>) {
        let mut out = String::new();
        let mut stopped = None;
        for p in pieces {
            let o = s.push(p);
            out.push_str(&o.emit);
            if o.stopped.is_some() {
                stopped = o.stopped;
                break;
            }
        }
        out.push_str(&s.finish());
        (out, stopped)
    }

    #[test]
    fn stop_split_across_pushes() {
        let mut s = stops(&["</answer>"]);
        let a = s.push("The result is 42</ans");
        assert_eq!(a.emit, "The result is 42");
        assert_eq!(a.stopped, None);
        let b = s.push("wer");
        assert_eq!(b.emit, "");
        let c = s.push("> trailing");
        assert_eq!(c, StopOutcome { emit: String::new(), stopped: Some(0) });
        assert_eq!(s.finish(), "");
        assert_eq!(s.push("more").emit, "");
        assert_eq!(s.stopped(), Some(0));
    }

    #[test]
    fn stop_in_one_push_truncates_there() {
        let mut s = stops(&["\n\n"]);
        let o = s.push("line one\n\nline two");
        assert_eq!(o, StopOutcome { emit: "line one".into(), stopped: Some(0) });
    }

    #[test]
    fn held_back_text_is_flushed_at_finish() {
        let mut s = stops(&["STOP"]);
        let o = s.push("almost ST");
        assert_eq!(o.emit, "almost ");
        assert_eq!(s.push("O").emit, "");
        assert_eq!(s.finish(), "STO");
        assert_eq!(s.finish(), "");
    }

    #[test]
    fn false_start_is_released_when_disproved() {
        let mut s = stops(&["abc"]);
        assert_eq!(s.push("xa").emit, "x");
        assert_eq!(s.push("b").emit, "");
        assert_eq!(s.push("d").emit, "abd");
        // An overlapping restart: "aab" then "c".
        assert_eq!(s.push("aab").emit, "a");
        assert_eq!(s.push("c").stopped, Some(0));
    }

    #[test]
    fn earliest_match_wins() {
        let mut s = stops(&["world", "lo, w", "o"]);
        let (out, stopped) = run(&mut s, &["Hello, world"]);
        assert_eq!((out.as_str(), stopped), ("Hel", Some(1)));

        // Same start: the lower index is reported.
        let mut s = stops(&["ab", "abc"]);
        assert_eq!(run(&mut s, &["xxabc"]), ("xx".to_string(), Some(0)));

        // Split over pushes, the later-listed stop starts first.
        let mut s = stops(&["cd", "bc"]);
        assert_eq!(run(&mut s, &["ab", "cd"]), ("a".to_string(), Some(1)));
    }

    #[test]
    fn no_stop_passes_everything_through() {
        let mut s = stops(&["<|end|>", ""]);
        let (out, stopped) = run(&mut s, &["Hello", " <", "|en", "d| no", " stop here"]);
        assert_eq!(out, "Hello <|end| no stop here");
        assert_eq!(stopped, None);

        let mut none = StopStrings::new(Vec::new());
        assert_eq!(none.push("anything <").emit, "anything <");
        assert_eq!(none.finish(), "");
    }

    #[test]
    fn multibyte_text_and_stops() {
        let mut s = stops(&["ünï", "😀!"]);
        assert_eq!(s.push("grüß ü").emit, "grüß ");
        assert_eq!(s.push("n").emit, "");
        assert_eq!(s.push("o 😀").emit, "üno ");
        let o = s.push("!x");
        assert_eq!(o, StopOutcome { emit: String::new(), stopped: Some(1) });
    }
}
