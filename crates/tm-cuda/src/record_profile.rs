//! Where the host's time goes while a step is recorded for the graph cache
//! (`TM_RECORD_PROFILE=1`): the time from one launch (or signed product) to the next is charged
//! to the later one's kernel name, so each name's share is the host work of the op that launches
//! it (validation, planning, uploads, signing). Logged at info level when the device closes, the
//! costliest names first. Off by default: it costs a clock read and a map update per launch.

use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Whether `TM_RECORD_PROFILE=1` asks for the profile.
pub(crate) fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("TM_RECORD_PROFILE").is_ok_and(|v| v.trim() == "1"))
}

/// Host time per kernel name over the recorded steps.
#[derive(Debug, Default)]
pub(crate) struct RecordProfile {
    /// When the last launch of the step being recorded was signed; `None` outside a step.
    last: Option<Instant>,
    /// Name → (launches, host time before them).
    by_name: HashMap<String, (u64, Duration)>,
    /// Steps recorded.
    steps: u64,
}

/// The name the time after a step's last launch is charged to.
const TAIL: &str = "(after the last launch)";

impl RecordProfile {
    /// A step starts being recorded.
    pub(crate) fn start(&mut self) {
        self.last = Some(Instant::now());
        self.steps += 1;
    }

    /// Charges the time since the previous launch to `name`.
    pub(crate) fn mark(&mut self, name: &str) {
        let Some(last) = self.last else { return };
        let now = Instant::now();
        let e = match self.by_name.get_mut(name) {
            Some(e) => e,
            None => self.by_name.entry(name.to_string()).or_default(),
        };
        e.0 += 1;
        e.1 += now - last;
        self.last = Some(now);
    }

    /// The step's recording ends: the rest goes to [`TAIL`].
    pub(crate) fn end(&mut self) {
        if self.last.is_some() {
            self.mark(TAIL);
            self.last = None;
        }
    }

    /// The lines of the report: per name, host microseconds and launches per step, costliest
    /// first, with the total.
    pub(crate) fn report(&self) -> Vec<String> {
        if self.steps == 0 {
            return Vec::new();
        }
        let steps = self.steps as f64;
        let mut rows: Vec<_> = self.by_name.iter().collect();
        rows.sort_by_key(|r| std::cmp::Reverse(r.1 .1));
        let total: Duration = rows.iter().map(|r| r.1 .1).sum();
        let mut out = vec![format!(
            "record profile: {:.1} us per step over {} steps ({} names)",
            total.as_secs_f64() * 1e6 / steps,
            self.steps,
            rows.len()
        )];
        for (name, (count, time)) in rows {
            out.push(format!(
                "  {:>8.2} us/step {:>6.1} launches/step {:>6.3} us each  {name}",
                time.as_secs_f64() * 1e6 / steps,
                *count as f64 / steps,
                time.as_secs_f64() * 1e6 / (*count).max(1) as f64
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_time_to_the_next_launch_and_sorts_by_cost() {
        let mut p = RecordProfile::default();
        p.mark("outside a step");
        assert!(p.by_name.is_empty() && p.report().is_empty());
        for _ in 0..2 {
            p.start();
            std::thread::sleep(Duration::from_millis(3));
            p.mark("slow");
            p.mark("fast");
            p.mark("fast");
            p.end();
        }
        assert_eq!(p.by_name["slow"].0, 2);
        assert_eq!(p.by_name["fast"].0, 4);
        assert_eq!(p.by_name[TAIL].0, 2);
        assert!(p.by_name["slow"].1 >= Duration::from_millis(6));
        let r = p.report();
        assert!(r[0].contains("over 2 steps (3 names)"), "{r:?}");
        assert!(r[1].ends_with("slow") && r[1].contains("1.0 launches/step"), "{r:?}");
    }
}
