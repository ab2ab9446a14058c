//! Per-step timings with CUDA events: while profiling is on, a run is launched step
//! by step (not as a captured graph) with an event after every step, and the time
//! between consecutive events is summed per step once the run has finished.

use crate::gpu::cuda_error;
use cudarc::driver::{result as driver, sys};
use rlx_ir::Result;
use std::time::Duration;

/// Events around each step of one run and the totals over the runs so far.
pub(crate) struct StepTimer {
    /// `steps + 1` events: the first before the first step, then one after each.
    events: Vec<sys::CUevent>,
    /// Time in each step, summed over `runs`.
    totals: Vec<Duration>,
    /// Runs whose times are in `totals`.
    pub runs: u64,
    /// Whether events were recorded by a run not yet read back.
    recorded: bool,
}

// The events are used by the program that owns the timer, one thread at a time.
unsafe impl Send for StepTimer {}

impl StepTimer {
    /// A timer for `steps` steps (the context must be current).
    pub fn new(steps: usize) -> Result<StepTimer> {
        let mut timer = StepTimer {
            events: Vec::with_capacity(steps + 1),
            totals: vec![Duration::ZERO; steps],
            runs: 0,
            recorded: false,
        };
        for _ in 0..=steps {
            let event = driver::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
                .map_err(|e| cuda_error("creating a timing event", e))?;
            timer.events.push(event);
        }
        Ok(timer)
    }

    /// Records event `index` (0 before the first step, `i + 1` after step `i`).
    pub fn mark(&mut self, index: usize, stream: sys::CUstream) -> Result<()> {
        self.recorded = true;
        // SAFETY: the event was created by `new` and lives until the timer drops.
        unsafe { driver::event::record(self.events[index], stream) }
            .map_err(|e| cuda_error("recording a timing event", e))
    }

    /// Adds the last run's step times to the totals (after the stream finished).
    pub fn collect(&mut self) -> Result<()> {
        if !std::mem::take(&mut self.recorded) {
            return Ok(());
        }
        for (i, total) in self.totals.iter_mut().enumerate() {
            // SAFETY: both events were recorded on the program's stream, which has
            // been synchronized.
            let ms = unsafe { driver::event::elapsed(self.events[i], self.events[i + 1]) }
                .map_err(|e| cuda_error("reading a timing event", e))?;
            *total += Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3);
        }
        self.runs += 1;
        Ok(())
    }

    /// Time in each step over the collected runs.
    pub fn totals(&self) -> &[Duration] {
        &self.totals
    }
}

impl Drop for StepTimer {
    fn drop(&mut self) {
        for &event in &self.events {
            // SAFETY: created by `new`, destroyed once.
            unsafe {
                let _ = driver::event::destroy(event);
            }
        }
    }
}
