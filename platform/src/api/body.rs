//! Reading request bodies against the clock.
//!
//! A body is cut with 408 when nothing of it arrives for the body timeout (silence), and when it
//! falls behind a minimum rate: it may take the body timeout plus one second for every
//! `min_rate` bytes it has sent, so that a client trickling a byte a second holds its connection
//! for the body timeout and no longer, while a large upload over a slow link is never cut. The
//! clock runs on the raw payload, below any multipart parsing, so that every way of reading a
//! body (JSON, a form's fields) is held to the same pace.

use std::cell::Cell;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};
use std::time::Duration;

use actix_web::error::PayloadError;
use actix_web::web::{self, Bytes};
use futures::Stream;
use tokio::time::{Instant, Sleep};

use super::{ApiError, ApiSettings};

/// How a paced body is held to its pace.
#[derive(Debug, Clone, Copy)]
pub struct Pace {
    /// Longest wait for the next bytes, and the grace the rate is measured after.
    pub silence: Duration,
    /// Bytes per second the body must keep up, on average, past its grace.
    pub min_rate: u64,
}

impl Pace {
    pub fn of(settings: &ApiSettings) -> Self {
        Pace { silence: settings.body_timeout, min_rate: settings.body_min_rate.max(1) }
    }

    /// When a body that has sent `bytes` since `started` is behind its rate.
    fn rate_deadline(&self, started: Instant, bytes: u64) -> Instant {
        let earned = Duration::from_secs_f64(bytes as f64 / self.min_rate as f64);
        started + self.silence.saturating_add(earned.min(Duration::from_secs(365 * 86_400)))
    }
}

/// Why a paced body was cut, for the error its reader returns.
#[derive(Clone, Default)]
pub struct BodyClock(Rc<Cell<Option<String>>>);

impl BodyClock {
    /// The error for a failure `other` of reading the body: the clock's 408 when it cut the
    /// body (the reader above sees that as a payload error), `other` otherwise.
    pub fn error(&self, other: impl FnOnce() -> ApiError) -> ApiError {
        match self.0.take() {
            Some(why) => ApiError::Timeout(why),
            None => other(),
        }
    }
}

/// A body stream held to a [`Pace`]; it ends with an error once the pace is broken.
pub struct Paced<S> {
    inner: S,
    pace: Pace,
    clock: BodyClock,
    started: Instant,
    bytes: u64,
    /// Armed while the inner stream has nothing: the earlier of the silence's and the rate's end.
    timer: Option<Pin<Box<Sleep>>>,
    silence_ends: Instant,
    cut: bool,
}

/// `payload`, paced by `settings`, and the clock its readers map errors with.
pub fn paced(payload: web::Payload, settings: &ApiSettings) -> (Paced<web::Payload>, BodyClock) {
    Paced::new(payload, Pace::of(settings))
}

impl<S> Paced<S> {
    pub fn new(inner: S, pace: Pace) -> (Self, BodyClock) {
        let clock = BodyClock::default();
        let now = Instant::now();
        let paced = Paced { inner, pace, clock: clock.clone(), started: now, bytes: 0, timer: None, silence_ends: now, cut: false };
        (paced, clock)
    }
}

impl<S> Stream for Paced<S>
where
    S: Stream<Item = Result<Bytes, PayloadError>> + Unpin,
{
    type Item = Result<Bytes, PayloadError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.cut {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.inner).poll_next(cx) {
            Poll::Ready(Some(Ok(bytes))) => {
                this.bytes = this.bytes.saturating_add(bytes.len() as u64);
                this.timer = None;
                return Poll::Ready(Some(Ok(bytes)));
            }
            Poll::Ready(other) => {
                this.timer = None;
                return Poll::Ready(other);
            }
            Poll::Pending => {}
        }
        let now = Instant::now();
        let rate_ends = this.pace.rate_deadline(this.started, this.bytes);
        if this.timer.is_none() {
            // Silence is counted from when the reader began to wait, not from the last bytes:
            // time the server spent on what it read is not the client's.
            this.silence_ends = now + this.pace.silence;
            this.timer = Some(Box::pin(tokio::time::sleep_until(this.silence_ends.min(rate_ends))));
        }
        let timer = this.timer.as_mut().expect("armed above");
        if timer.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        this.cut = true;
        this.timer = None;
        // The bytes have not changed since the timer was armed: neither has the rate's end.
        let why = if this.silence_ends <= rate_ends {
            format!("the request body stalled: nothing arrived for {} s", this.pace.silence.as_secs_f64())
        } else {
            format!(
                "the request body is too slow: {} bytes in {:.0} s, below the minimum of {} bytes a second after the first {} s",
                this.bytes,
                now.duration_since(this.started).as_secs_f64(),
                this.pace.min_rate,
                this.pace.silence.as_secs_f64()
            )
        };
        this.clock.0.set(Some(why.clone()));
        Poll::Ready(Some(Err(PayloadError::Io(std::io::Error::new(std::io::ErrorKind::TimedOut, why)))))
    }
}

#[cfg(test)]
mod tests {
    use futures::StreamExt;

    use super::*;

    /// A body that sends `chunk` bytes every `every`.
    fn trickle(chunk: usize, every: Duration, chunks: usize) -> impl Stream<Item = Result<Bytes, PayloadError>> + Unpin {
        Box::pin(futures::stream::unfold(0, move |i| async move {
            if i == chunks {
                return None;
            }
            tokio::time::sleep(every).await;
            Some((Ok(Bytes::from(vec![b'x'; chunk])), i + 1))
        }))
    }

    async fn read(stream: impl Stream<Item = Result<Bytes, PayloadError>> + Unpin, pace: Pace) -> (u64, Result<(), ApiError>) {
        let (mut body, clock) = Paced::new(stream, pace);
        let mut got = 0;
        while let Some(chunk) = body.next().await {
            match chunk {
                Ok(b) => got += b.len() as u64,
                Err(e) => return (got, Err(clock.error(|| ApiError::Invalid(e.to_string())))),
            }
        }
        (got, Ok(()))
    }

    #[actix_web::test]
    async fn a_trickle_is_cut_after_the_grace_and_a_steady_body_is_not() {
        let pace = Pace { silence: Duration::from_millis(300), min_rate: 1000 };
        // 1 byte each 50 ms: 20 bytes a second, far below the rate, though never silent.
        let started = std::time::Instant::now();
        let (got, res) = read(trickle(1, Duration::from_millis(50), 100), pace).await;
        let took = started.elapsed();
        match res {
            Err(ApiError::Timeout(why)) => assert!(why.contains("too slow") && why.contains("1000 bytes a second"), "{why}"),
            other => panic!("{other:?}"),
        }
        assert!(got < 20, "{got} bytes were taken");
        assert!(took < Duration::from_millis(900), "cut at {took:?}");
        // 100 bytes each 50 ms: 2000 bytes a second, above the rate, for longer than the grace.
        let (got, res) = read(trickle(100, Duration::from_millis(50), 30), pace).await;
        assert!(res.is_ok(), "{res:?}");
        assert_eq!(got, 3000);
    }

    #[actix_web::test]
    async fn silence_is_cut_with_its_own_message() {
        let pace = Pace { silence: Duration::from_millis(200), min_rate: 1 };
        let stalled = Box::pin(futures::stream::iter([Ok(Bytes::from_static(b"{"))]).chain(futures::stream::pending()));
        let (got, res) = read(stalled, pace).await;
        assert_eq!(got, 1);
        match res {
            Err(ApiError::Timeout(why)) => assert!(why.contains("nothing arrived for 0.2 s"), "{why}"),
            other => panic!("{other:?}"),
        }
    }

    #[actix_web::test]
    async fn other_failures_keep_their_own_error() {
        let pace = Pace { silence: Duration::from_secs(5), min_rate: 1 };
        let broken = Box::pin(futures::stream::iter([Err(PayloadError::Incomplete(None))]));
        let (_, res) = read(broken, pace).await;
        assert!(matches!(res, Err(ApiError::Invalid(_))), "{res:?}");
    }
}
