//! How many ranged GETs go to one server at once.
//!
//! `$FASTSAFETENSORS_REMOTE_CONCURRENCY` pins the number. Without it, the number is found per
//! server while it is read: [`START`] GETs in flight; after each round (as many parts landed as
//! there are GETs in flight, over at least [`MIN_ROUND`]), the number doubles if that round ran
//! at least [`GAIN`] faster than the one before (the first round always doubles, to have a
//! second to compare), up to [`MAX`]. Once a doubling gains less, the number stays, for the
//! process: a later load from that server starts there. A high round-trip time needs many bytes
//! in flight to fill a link, a loopback server only a few before the client's CPU is the limit;
//! each request costs CPU, so no more are sent than buy a faster load.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::{Semaphore, SemaphorePermit};

/// GETs in flight to a server at first.
pub const START: usize = 8;
/// The most GETs in flight the climb reaches (a pinned number may be higher).
pub const MAX: usize = 64;
/// How much faster a round must run than the one before for the number to double again.
pub const GAIN: f64 = 0.10;
/// The shortest round judged: a rate over less time is noise.
pub const MIN_ROUND: Duration = Duration::from_millis(100);
/// A pause between parts this long starts a new round rather than ending one (a gap between
/// two loads is not a slow round).
const IDLE: Duration = Duration::from_secs(1);

/// The GETs in flight to one server: slots, and the climb that adds them.
pub struct InFlight {
    slots: Semaphore,
    /// `None` when the number is pinned, or settled.
    climb: Mutex<Option<Climb>>,
}

impl InFlight {
    /// Exactly `n` in flight.
    pub fn pinned(n: usize) -> InFlight {
        InFlight { slots: Semaphore::new(n), climb: Mutex::new(None) }
    }

    /// [`START`] in flight, more as long as they make the reads faster.
    pub fn adaptive() -> InFlight {
        InFlight { slots: Semaphore::new(START), climb: Mutex::new(Some(Climb::new(START))) }
    }

    /// A slot for one GET, once one is free.
    pub async fn slot(&self) -> SemaphorePermit<'_> {
        self.slots.acquire().await.expect("the semaphore is never closed")
    }

    /// A GET of `bytes` has landed whole.
    pub fn landed(&self, bytes: u64) {
        let mut climb = self.climb.lock().unwrap_or_else(|p| p.into_inner());
        let Some(c) = climb.as_mut() else { return };
        match c.landed(Instant::now(), bytes) {
            Step::Same => {}
            Step::Grow(more) => self.slots.add_permits(more),
            Step::Settled => *climb = None,
        }
    }
}

/// What a part's landing changes.
#[derive(Debug, PartialEq, Eq)]
enum Step {
    Same,
    /// This many more GETs in flight from now on.
    Grow(usize),
    /// The number stays as it is.
    Settled,
}

/// The rounds of parts measured so far.
#[derive(Debug)]
struct Climb {
    limit: usize,
    round_start: Option<Instant>,
    last_landed: Option<Instant>,
    round_bytes: u64,
    round_parts: usize,
    /// Bytes per second of the round before, if one was judged.
    last_rate: Option<f64>,
}

impl Climb {
    fn new(limit: usize) -> Climb {
        Climb { limit, round_start: None, last_landed: None, round_bytes: 0, round_parts: 0, last_rate: None }
    }

    fn landed(&mut self, now: Instant, bytes: u64) -> Step {
        let idle = self.last_landed.is_none_or(|last| now.duration_since(last) > IDLE);
        self.last_landed = Some(now);
        let Some(start) = self.round_start.filter(|_| !idle) else {
            // The first part after a pause opens a round; its own bytes were fetched before it.
            self.round_start = Some(now);
            self.round_bytes = 0;
            self.round_parts = 0;
            return Step::Same;
        };
        self.round_bytes += bytes;
        self.round_parts += 1;
        let took = now.duration_since(start);
        if self.round_parts < self.limit || took < MIN_ROUND {
            return Step::Same;
        }
        let rate = self.round_bytes as f64 / took.as_secs_f64();
        let faster = self.last_rate.is_none_or(|last| rate >= last * (1.0 + GAIN));
        self.last_rate = Some(rate);
        self.round_start = Some(now);
        self.round_bytes = 0;
        self.round_parts = 0;
        if !faster || self.limit >= MAX {
            return Step::Settled;
        }
        let more = self.limit.min(MAX - self.limit);
        self.limit += more;
        Step::Grow(more)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: u64 = 1 << 20;

    /// Lands `parts` parts of `bytes` each, `gap` apart, from `at`; the steps that were not `Same`.
    fn round(c: &mut Climb, at: &mut Instant, parts: usize, bytes: u64, gap: Duration) -> Vec<Step> {
        let mut steps = Vec::new();
        for _ in 0..parts {
            *at += gap;
            match c.landed(*at, bytes) {
                Step::Same => {}
                step => steps.push(step),
            }
        }
        steps
    }

    #[test]
    fn doubles_while_rounds_get_faster_and_stops_at_the_first_that_does_not() {
        let mut c = Climb::new(8);
        let mut at = Instant::now();
        assert_eq!(c.landed(at, 8 * MB), Step::Same); // opens the first round
                                                      // Round 1 (8 parts at 8 in flight, over 160 ms): judged, and always doubled.
        assert_eq!(round(&mut c, &mut at, 8, 8 * MB, Duration::from_millis(20)), [Step::Grow(8)]);
        // Round 2 at 16: twice as fast (parts land twice as often): doubled again.
        assert_eq!(round(&mut c, &mut at, 16, 8 * MB, Duration::from_millis(10)), [Step::Grow(16)]);
        // Round 3 at 32: 5% faster only: settled at 32.
        assert_eq!(round(&mut c, &mut at, 32, 8 * MB, Duration::from_micros(9_524)), [Step::Settled]);
        assert_eq!(c.limit, 32);
    }

    #[test]
    fn never_past_max() {
        let mut c = Climb::new(48);
        let mut at = Instant::now();
        c.landed(at, MB);
        assert_eq!(round(&mut c, &mut at, 48, MB, Duration::from_millis(5)), [Step::Grow(MAX - 48)]);
        assert_eq!(round(&mut c, &mut at, 100, MB, Duration::from_millis(1)), [Step::Settled]);
        assert_eq!(c.limit, MAX);
    }

    #[test]
    fn short_rounds_are_not_judged_and_a_pause_opens_a_new_round() {
        let mut c = Climb::new(8);
        let mut at = Instant::now();
        c.landed(at, MB);
        // 8 parts within 8 ms: under MIN_ROUND, so the round goes on until 100 ms have passed.
        assert_eq!(round(&mut c, &mut at, 8, MB, Duration::from_millis(1)), []);
        assert_eq!(round(&mut c, &mut at, 92, MB, Duration::from_millis(1)), [Step::Grow(8)]);
        // Two seconds with nothing landed (between loads): the next part opens a round, and the
        // pause is not counted as a slow one.
        at += Duration::from_secs(2);
        assert_eq!(c.landed(at, MB), Step::Same);
        // ... judged against the round before it: four times as fast, so doubled again.
        assert_eq!(round(&mut c, &mut at, 100, 4 * MB, Duration::from_millis(1)), [Step::Grow(16)]);
    }

    #[test]
    fn pinned_numbers_do_not_change() {
        let pinned = InFlight::pinned(3);
        for _ in 0..1000 {
            pinned.landed(MB);
        }
        assert_eq!(pinned.slots.available_permits(), 3);
        assert_eq!(InFlight::adaptive().slots.available_permits(), START);
    }
}
