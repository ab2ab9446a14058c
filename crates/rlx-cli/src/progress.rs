//! A one-line progress bar on stderr: steps done, the loss, throughput and the time
//! left. On a terminal it redraws in place; otherwise it prints a line every tenth
//! of the run.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// Shows the progress of a run of `total` steps.
pub struct Progress {
    total: u64,
    label: String,
    terminal: bool,
    quiet: bool,
    last_draw: Option<Instant>,
    last_decile: u64,
}

impl Progress {
    /// A bar for `total` steps, or nothing when `quiet`.
    pub fn new(label: &str, total: u64, quiet: bool) -> Progress {
        Progress {
            total: total.max(1),
            label: label.to_string(),
            terminal: std::io::stderr().is_terminal(),
            quiet,
            last_draw: None,
            last_decile: 0,
        }
    }

    /// Reports that `done` steps are finished after `elapsed` seconds, the last with
    /// loss `loss`; `unit` names what the throughput counts, `per_step` of them a step.
    pub fn update(&mut self, done: u64, loss: f32, elapsed: f64, (unit, per_step): (&str, f64)) {
        if self.quiet {
            return;
        }
        let finished = done >= self.total;
        let line = self.line(done, loss, elapsed, unit, per_step);
        if self.terminal {
            let due = self
                .last_draw
                .is_none_or(|t| t.elapsed() >= Duration::from_millis(100));
            if due || finished {
                eprint!("\r\x1b[2K{line}");
                if finished {
                    eprintln!();
                }
                let _ = std::io::stderr().flush();
                self.last_draw = Some(Instant::now());
            }
        } else {
            let decile = done * 10 / self.total;
            if decile > self.last_decile || finished {
                self.last_decile = decile;
                eprintln!("{line}");
            }
        }
    }

    fn line(&self, done: u64, loss: f32, elapsed: f64, unit: &str, per_step: f64) -> String {
        const WIDTH: u64 = 24;
        let filled = (done * WIDTH / self.total) as usize;
        let bar: String = "#".repeat(filled) + &"-".repeat(WIDTH as usize - filled);
        let rate = if elapsed > 0.0 {
            done as f64 / elapsed
        } else {
            0.0
        };
        let left = if rate > 0.0 {
            (self.total - done.min(self.total)) as f64 / rate
        } else {
            0.0
        };
        format!(
            "{} [{bar}] {done}/{} loss {loss:.4} | {} {unit}/s | {} elapsed, ETA {}",
            self.label,
            self.total,
            human(rate * per_step),
            clock(elapsed),
            clock(left)
        )
    }
}

fn human(x: f64) -> String {
    if x >= 1e6 {
        format!("{:.2}M", x / 1e6)
    } else if x >= 1e4 {
        format!("{:.1}k", x / 1e3)
    } else {
        format!("{x:.0}")
    }
}

/// `m:ss`, or `h:mm:ss` past an hour.
pub fn clock(seconds: f64) -> String {
    let s = seconds.max(0.0).round() as u64;
    if s >= 3600 {
        format!("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
    } else {
        format!("{}:{:02}", s / 60, s % 60)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_says_steps_loss_rate_and_time_left() {
        let p = Progress::new("digits", 200, true);
        let line = p.line(50, 0.25, 5.0, "images", 32.0);
        assert!(line.contains("[######------------------] 50/200"), "{line}");
        assert!(line.contains("loss 0.2500"), "{line}");
        assert!(line.contains("320 images/s"), "{line}");
        assert!(line.contains("0:05 elapsed, ETA 0:15"), "{line}");
        assert_eq!(clock(3725.0), "1:02:05");
        assert_eq!(human(123456.0), "123.5k");
    }
}
