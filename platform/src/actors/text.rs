//! A worker's text stage: its requests' tokens made into text, beside the step loop.
//!
//! The step thread hands each step's token events here and goes on to the next step; this
//! thread detokenizes them, cuts each sample's text at its stop strings
//! ([`crate::engine::text`]), streams the events to the requests and sends each request's
//! final event. Everything a worker sends a request goes through here, in order: a terminal
//! event the worker decides (a cancel, a failure) follows the tokens queued before it.
//!
//! A stop string is found here after the step that completed it; the worker is then told to
//! cancel the sample ([`TextEnded`]), and the tokens its engine generated in between are
//! dropped: they are neither streamed nor counted as completion tokens.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::time::Instant;

use actix::{Message, Recipient};
use tokio::sync::mpsc::UnboundedSender;

use super::{Event, RequestId, RuntimeError, TokenOut, Usage};
use crate::engine::{SeqId, SeqText, TokenEvent};
use crate::request::SeqError;
use crate::tokenizer::Tokenizer;

/// What the worker hands its text stage.
pub(crate) enum TextJob {
    /// A request the engine accepted: its samples' sequences (in sample order) and stop strings.
    Open { id: RequestId, seqs: Vec<SeqId>, stop_strings: Vec<String>, events: UnboundedSender<Event>, submitted: Instant, added: Instant },
    /// One step's tokens.
    Tokens(Vec<TokenEvent>),
    /// Ends a request with this event, after what was queued before it (unless it has ended).
    Close { id: RequestId, event: Event },
}

/// From the text stage to its worker: the text of these sequences of a request ended before
/// the engine ended them (a stop string, a token that cannot be detokenized, a client that went
/// away); cancel them. Their request's events have been sent.
#[derive(Message, Debug, Clone, PartialEq, Eq)]
#[rtype(result = "()")]
pub(crate) struct TextEnded {
    pub id: RequestId,
    pub seqs: Vec<SeqId>,
}

/// The handle of a worker's text thread; the thread ends once the handle is dropped and its
/// queue drained.
pub(crate) struct TextStage {
    jobs: Sender<TextJob>,
}

impl TextStage {
    pub fn start(worker: usize, tokenizer: Arc<Tokenizer>, back: Recipient<TextEnded>) -> std::io::Result<Self> {
        let (jobs, queue) = channel();
        std::thread::Builder::new().name(format!("loraplex-text-{worker}")).spawn(move || run(queue, &tokenizer, &back))?;
        Ok(Self { jobs })
    }

    /// Queues a job; false if the thread has gone (it only ends when this handle is dropped, or
    /// by a panic).
    pub fn send(&self, job: TextJob) -> bool {
        self.jobs.send(job).is_ok()
    }
}

/// One request's text state.
struct Flight {
    events: UnboundedSender<Event>,
    seqs: Vec<SeqId>,
    texts: Vec<SeqText>,
    /// Samples whose text has not ended.
    open: usize,
    submitted: Instant,
    added: Instant,
    usage: Usage,
    first_token: Option<Instant>,
}

fn run(queue: Receiver<TextJob>, tokenizer: &Tokenizer, back: &Recipient<TextEnded>) {
    let mut stage = Stage { flights: HashMap::new(), seqs: HashMap::new() };
    while let Ok(job) = queue.recv() {
        match job {
            TextJob::Open { id, seqs, stop_strings, events, submitted, added } => {
                for (index, seq) in seqs.iter().enumerate() {
                    stage.seqs.insert(*seq, (id, index));
                }
                let texts = seqs.iter().map(|_| SeqText::new(stop_strings.clone())).collect();
                let open = seqs.len();
                stage.flights.insert(id, Flight { events, seqs, texts, open, submitted, added, usage: Usage::default(), first_token: None });
            }
            TextJob::Tokens(events) => {
                for e in events {
                    if let Some(ended) = stage.take(tokenizer, e) {
                        back.do_send(ended);
                    }
                }
            }
            TextJob::Close { id, event } => {
                if let Some(flight) = stage.remove(id) {
                    let _ = flight.events.send(event);
                }
            }
        }
    }
}

struct Stage {
    flights: HashMap<RequestId, Flight>,
    /// Which request and sample each sequence belongs to.
    seqs: HashMap<SeqId, (RequestId, usize)>,
}

impl Stage {
    fn remove(&mut self, id: RequestId) -> Option<Flight> {
        let flight = self.flights.remove(&id)?;
        for seq in &flight.seqs {
            self.seqs.remove(seq);
        }
        Some(flight)
    }

    /// Takes one token; what the worker must cancel, if anything.
    fn take(&mut self, tokenizer: &Tokenizer, e: TokenEvent) -> Option<TextEnded> {
        let &(id, index) = self.seqs.get(&e.seq)?;
        let flight = self.flights.get_mut(&id)?;
        let text = flight.texts.get_mut(index)?;
        let piece = match text.push(tokenizer, e.token, e.finish) {
            Ok(piece) => piece?,
            Err(err) => {
                let flight = self.remove(id)?;
                let _ = flight.events.send(Event::Error(RuntimeError::Sequence(SeqError::Failed(err.to_string().into()))));
                return Some(TextEnded { id, seqs: flight.seqs });
            }
        };
        let now = Instant::now();
        flight.first_token.get_or_insert(now);
        if let (Some(u), 0) = (e.usage, index) {
            flight.usage.prompt_tokens = u.prompt_tokens;
            flight.usage.cached_prompt_tokens = u.cached_prompt_tokens;
            // The engine counts from when it queued the sequence; add the time the request
            // took to reach it.
            flight.usage.queue_time = u.queue_time + flight.added.saturating_duration_since(flight.submitted);
        }
        if piece.finish.is_some() {
            flight.open -= 1;
            flight.usage.completion_tokens += text.tokens();
        }
        let out = TokenOut { index, token: e.token, text: piece.text, logprob: e.logprob, top_logprobs: e.top_logprobs, finish: piece.finish };
        if flight.events.send(Event::Token(out)).is_err() {
            // The client went away: its samples can stop now.
            let flight = self.remove(id)?;
            return Some(TextEnded { id, seqs: flight.seqs });
        }
        if flight.open == 0 {
            let mut usage = flight.usage;
            let first = flight.first_token.unwrap_or(now);
            usage.time_to_first_token = first.saturating_duration_since(flight.submitted);
            usage.total_time = now.saturating_duration_since(flight.submitted);
            usage.queue_time = usage.queue_time.min(usage.time_to_first_token);
            let _ = flight.events.send(Event::Done(usage));
            self.remove(id);
        }
        piece.cut.then_some(TextEnded { id, seqs: vec![e.seq] })
    }
}
