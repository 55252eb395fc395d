//! Streaming detokenization: turn generated token ids into text one id at a time.
//!
//! Decoding ids one by one and concatenating is wrong in two ways: byte-level tokens can split a
//! multi-byte UTF-8 character (each half decodes to U+FFFD), and some decoders change a token's
//! text depending on what precedes it (for example stripping the leading space of the first
//! token). The scheme used by transformers' streamers and TGI avoids both: keep two offsets into
//! the ids, decode the window `ids[prefix_offset..]` and also `ids[prefix_offset..read_offset]`
//! (text already emitted, decoded with the same left context), and emit the difference. While
//! the window's text ends in U+FFFD the character may still be incomplete, so nothing is emitted
//! and the offsets stay put until a later token completes it (or [`DecodeStream::finish`]
//! flushes it).
//!
//! For byte-level BPE the concatenation of everything emitted equals `decode(all ids)`.

use super::{Tokenizer, TokenizerError};

const REPLACEMENT: char = '\u{FFFD}';

/// Incremental detokenizer for one sequence; see the module documentation.
#[derive(Debug)]
pub struct DecodeStream {
    skip_special_tokens: bool,
    ids: Vec<u32>,
    /// Start of the decoding window (context for the decoder, already emitted).
    prefix_offset: usize,
    /// End of the text emitted so far.
    read_offset: usize,
}

impl DecodeStream {
    /// A stream for one sequence. It holds no reference to the tokenizer, so a sequence can own
    /// it; every call takes the tokenizer the ids belong to.
    pub fn new(skip_special_tokens: bool) -> Self {
        Self { skip_special_tokens, ids: Vec::new(), prefix_offset: 0, read_offset: 0 }
    }

    /// Adds one token and returns the text it completes, if any. Never returns half a UTF-8
    /// character: text is held back while it ends in U+FFFD. An unknown id is an error and
    /// leaves the stream as it was.
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<Option<String>, TokenizerError> {
        tokenizer.check_ids(&[id])?;
        self.ids.push(id);
        let (prefix_len, new_text) = self.window(tokenizer)?;
        if new_text.len() <= prefix_len || new_text.ends_with(REPLACEMENT) {
            return Ok(None);
        }
        let chunk = suffix_from(&new_text, prefix_len).to_owned();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(Some(chunk))
    }

    /// Ends the sequence: returns whatever was held back (possibly containing U+FFFD when the
    /// sequence really ends inside a character) and resets the stream for reuse.
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> Result<Option<String>, TokenizerError> {
        let chunk = if self.read_offset < self.ids.len() {
            let (prefix_len, new_text) = self.window(tokenizer)?;
            (new_text.len() > prefix_len).then(|| suffix_from(&new_text, prefix_len).to_owned())
        } else {
            None
        };
        self.ids.clear();
        self.prefix_offset = 0;
        self.read_offset = 0;
        Ok(chunk)
    }

    /// Ids pushed since the last `finish`.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Decodes the already-emitted part of the window and the whole window.
    fn window(&self, tokenizer: &Tokenizer) -> Result<(usize, String), TokenizerError> {
        let skip = self.skip_special_tokens;
        let prefix = tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset], skip)?;
        let full = tokenizer.decode(&self.ids[self.prefix_offset..], skip)?;
        Ok((prefix.len(), full))
    }
}

/// `text[at..]`, moved back to a character boundary if `at` is inside a character (possible only
/// with decoders whose output for a longer window does not extend the shorter one).
fn suffix_from(text: &str, mut at: usize) -> &str {
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    &text[at..]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::tests::{fixture_tokenizer, reference};

    /// Pushes every id, checking the chunks, and returns the concatenation (finish included).
    fn stream_all(tok: &Tokenizer, ids: &[u32], skip: bool) -> String {
        let full = tok.decode(ids, skip).unwrap_or_else(|e| panic!("decode failed: {e}"));
        let mut stream = tok.decode_stream(skip);
        let mut out = String::new();
        for &id in ids {
            match stream.push(tok, id) {
                Ok(Some(chunk)) => {
                    assert!(!chunk.is_empty());
                    if !full.contains(REPLACEMENT) {
                        assert!(!chunk.contains(REPLACEMENT), "chunk {chunk:?} of {full:?} has U+FFFD");
                    }
                    out.push_str(&chunk);
                }
                Ok(None) => {}
                Err(e) => panic!("push({id}) failed: {e}"),
            }
        }
        if let Some(rest) = stream.finish(tok).unwrap_or_else(|e| panic!("finish failed: {e}")) {
            out.push_str(&rest);
        }
        assert_eq!(out, full, "streamed text differs from decode for {ids:?}");
        out
    }

    #[test]
    fn stream_equals_decode_for_every_reference_text() {
        let tok = fixture_tokenizer();
        let reference = reference();
        for enc in &reference.encodings {
            for skip in [true, false] {
                stream_all(&tok, &enc.ids_with_special, skip);
                stream_all(&tok, &enc.ids_without_special, skip);
            }
            assert_eq!(stream_all(&tok, &enc.ids_with_special, true), enc.decode_skip_special);
            assert_eq!(stream_all(&tok, &enc.ids_with_special, false), enc.decode_keep_special);
        }
        stream_all(&tok, &reference.chat.ids, false);
    }

    #[test]
    fn multibyte_characters_are_held_until_complete() {
        let tok = fixture_tokenizer();
        let text = "emoji 🙂🚀 and CJK 你好世界, accents é ö — mixed🙂x";
        let ids = tok.encode(text, false).unwrap_or_else(|e| panic!("{e}"));
        // The vocabulary is tiny, so these characters are split over byte tokens.
        assert!(ids.len() > text.chars().count() / 2);
        assert_eq!(stream_all(&tok, &ids, true), text);

        // 🙂 is F0 9F 99 82, one byte token each: nothing comes out until the last one.
        let emoji = tok.encode("🙂", false).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(emoji.len(), 4, "{emoji:?}");
        let mut stream = tok.decode_stream(true);
        let pushed: Vec<Option<String>> = emoji.iter().map(|&id| stream.push(&tok, id).unwrap_or_else(|e| panic!("{e}"))).collect();
        assert_eq!(pushed, vec![None, None, None, Some("🙂".to_owned())]);
        assert_eq!(stream.finish(&tok).ok(), Some(None));
    }

    #[test]
    fn chunks_follow_token_boundaries() {
        let tok = fixture_tokenizer();
        let ids = tok.encode("Hello world!", false).unwrap_or_else(|e| panic!("{e}"));
        let mut stream = tok.decode_stream(true);
        let chunks: Vec<String> = ids.iter().filter_map(|&id| stream.push(&tok, id).ok().flatten()).collect();
        let expected: Vec<String> = ids.iter().map(|&id| tok.decode(&[id], true).unwrap_or_default()).collect();
        assert_eq!(chunks, expected);
    }

    #[test]
    fn incomplete_tail_is_flushed_by_finish() {
        let tok = fixture_tokenizer();
        let ids = tok.encode("ok 你", false).unwrap_or_else(|e| panic!("{e}"));
        let cut = &ids[..ids.len() - 1]; // drop the last byte of 你
        let mut stream = tok.decode_stream(true);
        let mut out = String::new();
        for &id in cut {
            if let Some(chunk) = stream.push(&tok, id).unwrap_or_else(|e| panic!("{e}")) {
                assert!(!chunk.contains(REPLACEMENT));
                out.push_str(&chunk);
            }
        }
        assert_eq!(out, "ok ");
        let rest = stream.finish(&tok).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(rest.as_deref(), Some("\u{FFFD}"));
        assert_eq!(out + "\u{FFFD}", tok.decode(cut, true).unwrap_or_default());
        // The stream is reusable after finish.
        assert_eq!(stream.push(&tok, ids[0]).ok().flatten(), tok.decode(&ids[..1], true).ok());
    }

    #[test]
    fn special_tokens_in_stream() {
        let tok = fixture_tokenizer();
        let mut stream = tok.decode_stream(true);
        assert_eq!(stream.push(&tok, 2).ok(), Some(None)); // </s> is skipped
        let mut keep = tok.decode_stream(false);
        assert_eq!(keep.push(&tok, 2).ok(), Some(Some("</s>".to_owned())));
    }

    #[test]
    fn unknown_id_is_an_error_and_leaves_state() {
        let tok = fixture_tokenizer();
        let mut stream = tok.decode_stream(true);
        assert!(stream.push(&tok, 40).is_ok());
        let err = stream.push(&tok, 100_000);
        assert!(matches!(err, Err(TokenizerError::UnknownTokenId { id: 100_000, .. })), "{err:?}");
        assert_eq!(stream.ids(), &[40]);
    }

    /// A SentencePiece-style tokenizer (Llama 2 layout): `▁` for spaces, `<0xNN>` byte-fallback
    /// tokens, and a decoder that strips the leading space of whatever it decodes first.
    fn sentencepiece_style_tokenizer() -> (tempfile::TempDir, Tokenizer) {
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [
                {"id": 1, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
            ],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null,
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}
            ]},
            "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                "vocab": {"<unk>": 0, "<s>": 1, "▁Hello": 2, "▁world": 3, "<0xE4>": 4, "<0xBD>": 5, "<0xA0>": 6, "!": 7},
                "merges": []}
        });
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::write(dir.path().join("tokenizer.json"), json.to_string()).expect("write");
        let tok = Tokenizer::from_dir(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        (dir, tok)
    }

    #[test]
    fn context_dependent_decoders_stream_like_full_decode() {
        let (_dir, tok) = sentencepiece_style_tokenizer();
        let ids = [1, 2, 3, 4, 5, 6, 7, 3, 4, 5];
        // Decoding token by token would lose the spaces ("Helloworld") that the Strip decoder
        // removes from the first token of every decode call.
        assert_eq!(tok.decode(&ids[..8], true).ok().as_deref(), Some("Hello world你! world"));
        assert_eq!(tok.decode(&[3], true).ok().as_deref(), Some("world"));
        for skip in [true, false] {
            for end in 0..=ids.len() {
                stream_all(&tok, &ids[..end], skip);
            }
        }
        let mut stream = tok.decode_stream(true);
        let chunks: Vec<Option<String>> = ids[..8].iter().map(|&id| stream.push(&tok, id).ok().flatten()).collect();
        let expected = [None, Some("Hello"), Some(" world"), None, None, Some("你"), Some("!"), Some(" world")];
        assert_eq!(chunks, expected.map(|c| c.map(str::to_owned)));
    }
}
