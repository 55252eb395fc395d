//! A real byte-level BPE tokenizer of any vocabulary size, built without downloads.
//!
//! Layout (the same as the reference fixtures' tokenizer): the five special tokens, then the
//! 256 byte-level symbols in code-point order, then one token per merge. Merges are first learned
//! from a small embedded English text (so common words and fragments become single tokens), then,
//! once that text has no pair left to merge, extended with letter tokens joined pseudo-randomly
//! until the vocabulary is full. Every merged token is the concatenation of two earlier tokens.

use std::collections::{BTreeMap, HashMap};

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::processors::sequence::Sequence;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, OffsetReferential, OffsetType, PostProcessorWrapper, PreTokenizedString, PreTokenizer, Tokenizer};

use super::SynthError;
use crate::sampling::Xoshiro256;

/// Special tokens, with ids 0 to 4.
pub const SPECIAL_TOKENS: [&str; 5] = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"];

/// Text the first merges are learned from.
const CORPUS: &str = include_str!("corpus.txt");

/// Longest filler token, in byte-level symbols.
const MAX_FILLER_LEN: usize = 12;

/// The fixed seed of the filler merges: the tokenizer depends only on the vocabulary size.
const FILLER_SEED: u64 = 0x70CE_41E5;

fn tok_err(e: impl std::fmt::Display) -> SynthError {
    SynthError::Tokenizer(e.to_string())
}

/// Token strings by id and merges by rank, growing together.
struct Builder {
    tokens: Vec<String>,
    ids: HashMap<String, u32>,
    merges: Vec<(String, String)>,
}

impl Builder {
    fn add_token(&mut self, s: String) -> u32 {
        if let Some(&id) = self.ids.get(&s) {
            return id;
        }
        let id = self.tokens.len() as u32;
        self.ids.insert(s.clone(), id);
        self.tokens.push(s);
        id
    }

    /// Records the merge of tokens `a` and `b`; returns the id of the merged token.
    fn merge(&mut self, a: u32, b: u32) -> u32 {
        let (sa, sb) = (&self.tokens[a as usize], &self.tokens[b as usize]);
        self.merges.push((sa.clone(), sb.clone()));
        let joined = format!("{sa}{sb}");
        self.add_token(joined)
    }
}

/// The pre-tokenized words of the corpus (as byte-level symbol ids) with their counts.
fn corpus_words(b: &Builder) -> Result<Vec<(Vec<u32>, u64)>, SynthError> {
    let mut pre = PreTokenizedString::from(CORPUS);
    ByteLevel::new(false, true, true).pre_tokenize(&mut pre).map_err(tok_err)?;
    let mut counts: BTreeMap<&str, u64> = BTreeMap::new();
    for (word, _, _) in pre.get_splits(OffsetReferential::Original, OffsetType::Byte) {
        *counts.entry(word).or_insert(0) += 1;
    }
    counts
        .into_iter()
        .map(|(word, n)| {
            let symbols = word
                .chars()
                .map(|c| b.ids.get(c.encode_utf8(&mut [0; 4]) as &str).copied())
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| tok_err(format!("no byte-level symbol for a char of {word:?}")))?;
            Ok((symbols, n))
        })
        .collect()
}

/// Classic BPE training on the corpus: repeatedly merge the most frequent adjacent pair (ties:
/// lowest ids) until the vocabulary is full or no pair occurs twice.
fn learn_corpus_merges(b: &mut Builder, vocab_size: usize) -> Result<(), SynthError> {
    let mut words = corpus_words(b)?;
    while b.tokens.len() < vocab_size {
        let mut pairs: HashMap<(u32, u32), u64> = HashMap::new();
        for (w, n) in &words {
            for p in w.windows(2) {
                *pairs.entry((p[0], p[1])).or_insert(0) += n;
            }
        }
        let best = pairs.into_iter().max_by(|x, y| x.1.cmp(&y.1).then(y.0.cmp(&x.0)));
        let Some(((l, r), _)) = best.filter(|&(_, c)| c >= 2) else {
            break;
        };
        let new = b.merge(l, r);
        for (w, _) in &mut words {
            let mut out = Vec::with_capacity(w.len());
            let mut i = 0;
            while i < w.len() {
                if i + 1 < w.len() && w[i] == l && w[i + 1] == r {
                    out.push(new);
                    i += 2;
                } else {
                    out.push(w[i]);
                    i += 1;
                }
            }
            *w = out;
        }
    }
    Ok(())
}

/// A token made of lowercase ASCII letters, optionally after the byte-level space `Ġ`.
fn is_word_like(s: &str) -> bool {
    let letters = s.strip_prefix('Ġ').unwrap_or(s);
    !letters.is_empty() && letters.bytes().all(|c| c.is_ascii_lowercase())
}

/// Fills the vocabulary with word-like tokens: a word-like head plus a short letters-only tail.
fn add_filler_merges(b: &mut Builder, vocab_size: usize) -> Result<(), SynthError> {
    let is_tail = |s: &str| s.len() <= 3 && !s.starts_with('Ġ') && is_word_like(s);
    let mut heads: Vec<u32> = (0..b.tokens.len() as u32).filter(|&i| is_word_like(&b.tokens[i as usize])).collect();
    let mut tails: Vec<u32> = heads.iter().copied().filter(|&i| is_tail(&b.tokens[i as usize])).collect();
    let mut rng = Xoshiro256::seed_from_u64(FILLER_SEED);
    let mut attempts = 0usize;
    while b.tokens.len() < vocab_size {
        attempts += 1;
        if attempts > 64 * vocab_size + 1_000_000 {
            return Err(tok_err("could not find enough new tokens"));
        }
        let a = heads[(rng.next_u64() % heads.len() as u64) as usize];
        let c = tails[(rng.next_u64() % tails.len() as u64) as usize];
        let (sa, sc) = (&b.tokens[a as usize], &b.tokens[c as usize]);
        if sa.chars().count() + sc.chars().count() > MAX_FILLER_LEN || b.ids.contains_key(&format!("{sa}{sc}")) {
            continue;
        }
        let new = b.merge(a, c);
        heads.push(new);
        if is_tail(&b.tokens[new as usize]) {
            tails.push(new);
        }
    }
    Ok(())
}

/// Token strings by id and merges by rank.
pub(crate) struct BpeTables {
    pub tokens: Vec<String>,
    pub merges: Vec<(String, String)>,
}

/// The BPE tables for a vocabulary of exactly `vocab_size` tokens.
pub(crate) fn vocab_and_merges(vocab_size: usize) -> Result<BpeTables, SynthError> {
    let mut alphabet: Vec<char> = ByteLevel::alphabet().into_iter().collect();
    alphabet.sort_unstable();
    let base = SPECIAL_TOKENS.len() + alphabet.len();
    if vocab_size < base {
        return Err(tok_err(format!("a vocabulary needs at least {base} tokens")));
    }
    let mut b = Builder { tokens: Vec::with_capacity(vocab_size), ids: HashMap::with_capacity(vocab_size), merges: Vec::with_capacity(vocab_size - base) };
    for s in SPECIAL_TOKENS {
        b.add_token(s.to_string());
    }
    for c in alphabet {
        b.add_token(c.to_string());
    }
    learn_corpus_merges(&mut b, vocab_size)?;
    add_filler_merges(&mut b, vocab_size)?;
    Ok(BpeTables { tokens: b.tokens, merges: b.merges })
}

/// A complete `tokenizer.json` for a vocabulary of `vocab_size` tokens.
pub(crate) fn tokenizer_json(vocab_size: usize) -> Result<String, SynthError> {
    let BpeTables { tokens, merges } = vocab_and_merges(vocab_size)?;
    let vocab: Vocab = tokens.into_iter().enumerate().map(|(id, s)| (s, id as u32)).collect();
    let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().map_err(tok_err)?;

    let template = TemplateProcessing::builder()
        .try_single("<s> $A")
        .map_err(tok_err)?
        .try_pair("<s> $A <s>:1 $B:1")
        .map_err(tok_err)?
        .special_tokens(vec![("<s>", 1)])
        .build()
        .map_err(tok_err)?;
    let post = Sequence::new(vec![PostProcessorWrapper::ByteLevel(ByteLevel::new(true, false, true)), PostProcessorWrapper::Template(template)]);

    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer
        .with_pre_tokenizer(Some(ByteLevel::new(false, true, true)))
        .with_post_processor(Some(post))
        .with_decoder(Some(ByteLevelDecoder::new(true, true, true)));
    let specials: Vec<AddedToken> = SPECIAL_TOKENS.iter().map(|s| AddedToken::from(*s, true)).collect();
    tokenizer.add_special_tokens(&specials);
    let mut json = tokenizer.to_string(true).map_err(tok_err)?;
    json.push('\n');
    Ok(json)
}
