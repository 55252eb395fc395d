//! A sequence's text: its tokens detokenized as they arrive and cut at its stop strings.
//!
//! The engine works on tokens only: a step ends a sequence on an end-of-sequence or stop token
//! and at its length limit, never on text. Text is made here, by whoever consumes the engine's
//! events: the serving runtime on a thread beside the step loop (so the next step does not wait
//! for this one's text), [`Engine::run_to_completion`](super::Engine::run_to_completion) inline.
//! A stop string is therefore found after the step that completed it; the consumer then cancels
//! the sequence, and whatever the engine generated for it in between is dropped unseen and
//! uncounted.

use crate::request::FinishReason;
use crate::sampling::StopStrings;
use crate::tokenizer::{DecodeStream, Tokenizer, TokenizerError};

/// The text side of one sequence.
#[derive(Debug)]
pub struct SeqText {
    detok: DecodeStream,
    stop_strings: StopStrings,
    /// Tokens taken, up to and including the one that ended the text.
    tokens: usize,
    ended: bool,
}

/// What one token added to a sequence's text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextPiece {
    /// Text this token completed (empty while a character or a possible stop string is pending).
    pub text: String,
    /// Set when the text ended with this token: the engine's reason, or `Stop` for a stop
    /// string (possibly found in text the engine's own end released).
    pub finish: Option<FinishReason>,
    /// A stop string ended the text while the engine had not ended the sequence: the consumer
    /// must cancel it there.
    pub cut: bool,
}

impl SeqText {
    pub fn new(stop_strings: Vec<String>) -> Self {
        Self { detok: DecodeStream::new(true), stop_strings: StopStrings::new(stop_strings), tokens: 0, ended: false }
    }

    /// Whether the text has ended; later tokens are not part of it.
    pub fn ended(&self) -> bool {
        self.ended
    }

    /// The tokens that are part of the text: its completion tokens.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Takes the sequence's next token; `finish` is the engine's when this token ended the
    /// sequence there. An end-of-sequence or stop token (`Stop` from the engine) adds no text
    /// of its own. `None` once the text has ended: the token is not part of it.
    pub fn push(&mut self, tokenizer: &Tokenizer, token: u32, finish: Option<FinishReason>) -> Result<Option<TextPiece>, TokenizerError> {
        if self.ended {
            return Ok(None);
        }
        self.tokens += 1;
        let mut text = String::new();
        let mut end = finish;
        if finish != Some(FinishReason::Stop)
            && let Some(piece) = self.detok.push(tokenizer, token)?
        {
            let outcome = self.stop_strings.push(&piece);
            text = outcome.emit;
            if outcome.stopped.is_some() {
                end = Some(FinishReason::Stop);
            }
        }
        if end.is_some() {
            self.ended = true;
            if self.stop_strings.stopped().is_none() {
                self.flush_into(&mut text, tokenizer, &mut end)?;
            }
        }
        Ok(Some(TextPiece { text, cut: end.is_some() && finish.is_none(), finish: end }))
    }

    /// At the end of the text: releases what was held back for incomplete characters or
    /// possible stop strings, still cutting at a stop string if the tail completes one.
    fn flush_into(&mut self, text: &mut String, tokenizer: &Tokenizer, finish: &mut Option<FinishReason>) -> Result<(), TokenizerError> {
        if let Some(tail) = self.detok.finish(tokenizer)? {
            let outcome = self.stop_strings.push(&tail);
            text.push_str(&outcome.emit);
            if outcome.stopped.is_some() {
                *finish = Some(FinishReason::Stop);
                return Ok(());
            }
        }
        text.push_str(&self.stop_strings.finish());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> (tempfile::TempDir, Tokenizer) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tokenizer.json"), crate::synth::tokenizer::tokenizer_json(2048).unwrap()).unwrap();
        let t = Tokenizer::from_dir(dir.path()).unwrap();
        (dir, t)
    }

    /// Feeds `ids` with the engine ending the sequence (with `end`) at the last one; the pieces.
    fn feed(t: &Tokenizer, stops: &[&str], ids: &[u32], end: FinishReason) -> Vec<Option<TextPiece>> {
        let mut text = SeqText::new(stops.iter().map(|s| s.to_string()).collect());
        let last = ids.len() - 1;
        ids.iter().enumerate().map(|(i, &id)| text.push(t, id, (i == last).then_some(end)).unwrap()).collect()
    }

    fn joined(pieces: &[Option<TextPiece>]) -> String {
        pieces.iter().flatten().map(|p| p.text.as_str()).collect()
    }

    #[test]
    fn the_text_is_the_decoded_tokens_and_the_engine_end_releases_the_tail() {
        let (_d, t) = tokenizer();
        let ids = t.encode("the cat sat on the mat", false).unwrap();
        assert!(ids.len() >= 4, "{ids:?}");
        let pieces = feed(&t, &["sat on the rug"], &ids, FinishReason::Length);
        // Held back while it could still grow into the stop string, released at the end.
        assert_eq!(joined(&pieces), "the cat sat on the mat");
        let last = pieces.last().unwrap().as_ref().unwrap();
        assert_eq!((last.finish, last.cut), (Some(FinishReason::Length), false));
        assert!(pieces[..ids.len() - 1].iter().all(|p| p.as_ref().unwrap().finish.is_none()));
    }

    #[test]
    fn a_stop_string_across_tokens_ends_the_text_before_it_and_asks_for_a_cancel() {
        let (_d, t) = tokenizer();
        let ids = t.encode("the cat sat on the mat and more words after", false).unwrap();
        let mut text = SeqText::new(vec!["t on t".into()]);
        let mut out = String::new();
        let mut ended_at = None;
        for (i, &id) in ids.iter().enumerate() {
            match text.push(&t, id, None).unwrap() {
                Some(p) => {
                    out.push_str(&p.text);
                    if p.finish.is_some() {
                        assert_eq!((p.finish, p.cut), (Some(FinishReason::Stop), true));
                        ended_at = Some(i);
                    }
                }
                None => assert!(ended_at.is_some(), "only tokens after the end are not part of the text"),
            }
        }
        let ended_at = ended_at.expect("the stop string ended the text");
        assert_eq!(out, "the cat sa");
        assert_eq!(text.tokens(), ended_at + 1);
        assert!(text.ended());
        // The token that completed it is the first whose prefix holds the whole stop string.
        let before = t.decode(&ids[..ended_at], true).unwrap();
        let through = t.decode(&ids[..=ended_at], true).unwrap();
        assert!(!before.contains("t on t") && through.contains("t on t"), "{before:?} {through:?}");
    }

    #[test]
    fn an_end_of_sequence_token_adds_no_text_and_a_tail_can_still_complete_a_stop() {
        let (_d, t) = tokenizer();
        let mut ids = t.encode("hello world", false).unwrap();
        // `</s>` ends it (the engine's `Stop`): its own text is never decoded.
        ids.push(2);
        let pieces = feed(&t, &["zzz"], &ids, FinishReason::Stop);
        assert_eq!(joined(&pieces), "hello world");
        let last = pieces.last().unwrap().as_ref().unwrap();
        assert_eq!((last.finish, last.cut), (Some(FinishReason::Stop), false));

        // The engine's length limit ends it with "wor" held back for the stop string "world"
        // that never completes; the tail is released.
        let ids = t.encode("hello wor", false).unwrap();
        let pieces = feed(&t, &["world"], &ids, FinishReason::Length);
        assert_eq!(joined(&pieces), "hello wor");
        assert_eq!(pieces.last().unwrap().as_ref().unwrap().finish, Some(FinishReason::Length));
    }

    #[test]
    fn a_token_the_tokenizer_does_not_have_is_an_error() {
        let (_d, t) = tokenizer();
        let mut text = SeqText::new(Vec::new());
        assert!(text.push(&t, 1 << 20, None).is_err());
    }
}
