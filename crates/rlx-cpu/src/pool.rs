//! A fixed pool of worker threads for data-parallel kernels.
//!
//! `run(tasks, threads, f)` calls `f(task, thread)` for every task, spread over the
//! caller and up to `threads - 1` workers, and returns when all are done. It allocates
//! nothing. Workers spin briefly for the next job (kernels of one graph run back to
//! back), then sleep. One job runs at a time: a second caller that finds the pool busy
//! runs its tasks on its own thread instead of oversubscribing the cores.

use rlx_ir::{Error, Result};
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

type Job = dyn Fn(usize, usize) + Sync;

struct Shared {
    /// The job word: a count bumped (Release) when a job is published, times
    /// [`JOB_COUNT`], plus how many workers take part in that job. Workers watch it.
    /// The count of participants travels in the same word as the job's number so that
    /// a worker that wakes late decides on the job it saw: read from a separate field,
    /// it could see the next job's count, join a job it was not counted in, and leave
    /// that job's `pending` one short (the caller then waits forever or returns while
    /// a worker still runs).
    generation: AtomicU64,
    /// The current job, valid while a `run` is in progress.
    job: UnsafeCell<Option<&'static Job>>,
    next_task: AtomicUsize,
    tasks: AtomicUsize,
    /// Workers that have not yet finished the current job.
    pending: AtomicUsize,
    panicked: AtomicBool,
    sleep_lock: Mutex<()>,
    wake: Condvar,
    /// Workers asleep on `wake` (or about to be): a job only pays for a wake-up call
    /// when one is.
    sleepers: AtomicUsize,
    shutdown: AtomicBool,
}

// SAFETY: `job` is written only by the thread holding `ThreadPool::busy`, before the
// Release bump of `generation`, and read by workers after an Acquire load of it; it is
// cleared only after every participant has finished (`pending == 0`).
unsafe impl Sync for Shared {}

/// A pool of worker threads; see the module docs.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: usize,
    busy: Mutex<()>,
}

/// The job word's unit for the job count (below it: the participants).
const JOB_COUNT: u64 = 1 << 20;

/// How long an idle worker spins before it sleeps.
const SPIN: Duration = Duration::from_millis(2);

/// Spins of an idle worker before it starts yielding its core between checks.
const PURE_SPINS: u32 = 1 << 10;

impl ThreadPool {
    /// A pool that runs jobs on the caller plus `threads - 1` workers.
    pub fn new(threads: usize) -> ThreadPool {
        let shared = Arc::new(Shared {
            generation: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            next_task: AtomicUsize::new(0),
            tasks: AtomicUsize::new(0),
            pending: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            sleep_lock: Mutex::new(()),
            wake: Condvar::new(),
            sleepers: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
        });
        let workers = (threads.max(1) - 1).min(JOB_COUNT as usize - 1);
        let mut spawned = 0;
        for index in 0..workers {
            let shared = shared.clone();
            let ok = std::thread::Builder::new()
                .name(format!("rlx-cpu-{}", index + 1))
                .spawn(move || worker(&shared, index))
                .is_ok();
            if ok {
                spawned += 1;
            }
        }
        ThreadPool {
            shared,
            workers: spawned,
            busy: Mutex::new(()),
        }
    }

    /// The process-wide pool: `$RLX_NUM_THREADS` threads, else one per available core.
    pub fn global() -> &'static ThreadPool {
        static POOL: OnceLock<ThreadPool> = OnceLock::new();
        POOL.get_or_init(|| ThreadPool::new(default_threads()))
    }

    /// Threads a job can use (the caller included).
    pub fn threads(&self) -> usize {
        self.workers + 1
    }

    /// Calls `f(task, thread)` for every `task < tasks` on at most `threads` threads
    /// (`thread < threads`; 0 is the caller) and waits for all of them. A task that
    /// panics (a kernel bug) is reported as an error once every thread has stopped.
    pub fn run(
        &self,
        tasks: usize,
        threads: usize,
        f: &(dyn Fn(usize, usize) + Sync),
    ) -> Result<()> {
        let helpers = threads
            .saturating_sub(1)
            .min(self.workers)
            .min(tasks.saturating_sub(1));
        let guard = if helpers == 0 {
            None
        } else {
            self.busy.try_lock().ok()
        };
        let Some(_guard) = guard else {
            for t in 0..tasks {
                f(t, 0);
            }
            return Ok(());
        };
        let s = &*self.shared;
        // SAFETY: the job reference is only used until `pending` reaches 0 below,
        // while `f` is still borrowed by this call; the lifetime is erased for storage.
        let job: &'static Job =
            unsafe { std::mem::transmute::<&(dyn Fn(usize, usize) + Sync + '_), &'static Job>(f) };
        // SAFETY: only the holder of `busy` writes `job`, and no worker reads it until
        // the generation bump below.
        unsafe { *s.job.get() = Some(job) };
        s.next_task.store(0, Ordering::Relaxed);
        s.tasks.store(tasks, Ordering::Relaxed);
        s.pending.store(helpers, Ordering::Relaxed);
        // SeqCst with the sleepers count: either a worker about to sleep sees the new
        // generation, or this sees it counted and wakes it under the lock it sleeps
        // with. Spinning workers need no call.
        let count = s.generation.load(Ordering::Relaxed) / JOB_COUNT;
        s.generation
            .store((count + 1) * JOB_COUNT + helpers as u64, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _lock = s.sleep_lock.lock();
            s.wake.notify_all();
        }
        let mine =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| claim_tasks(s, job, 0)));
        let mut spins = 0u32;
        while s.pending.load(Ordering::Acquire) != 0 {
            spins += 1;
            if spins < 1 << 14 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        // SAFETY: every participant has finished with the job.
        unsafe { *s.job.get() = None };
        if s.panicked.swap(false, Ordering::Relaxed) || mine.is_err() {
            return Err(Error::runtime(
                "cpu thread pool",
                "a kernel task panicked (an internal bug; please report it)",
            ));
        }
        Ok(())
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        self.shared
            .generation
            .fetch_add(JOB_COUNT, Ordering::Release);
        let _lock = self.shared.sleep_lock.lock();
        self.shared.wake.notify_all();
    }
}

fn claim_tasks(s: &Shared, job: &Job, thread: usize) {
    let tasks = s.tasks.load(Ordering::Relaxed);
    loop {
        let t = s.next_task.fetch_add(1, Ordering::Relaxed);
        if t >= tasks {
            break;
        }
        job(t, thread);
    }
}

fn worker(s: &Shared, index: usize) {
    let mut seen = 0u64;
    loop {
        let start = Instant::now();
        let mut generation = s.generation.load(Ordering::Acquire);
        let mut spins = 0u32;
        while generation == seen {
            spins = spins.saturating_add(1);
            if spins < PURE_SPINS {
                std::hint::spin_loop();
            } else if start.elapsed() < SPIN {
                // Past a short spin, offer the core to any other runnable thread on
                // each pass: with more threads than free cores (a shared machine, a
                // second process), a spinning idle worker would otherwise hold the
                // core a job's own worker needs, and every job would wait a
                // scheduler time slice for it.
                std::thread::yield_now();
            } else {
                let lock = s.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
                s.sleepers.fetch_add(1, Ordering::SeqCst);
                generation = s.generation.load(Ordering::SeqCst);
                if generation == seen {
                    let _unused = s.wake.wait(lock);
                }
                s.sleepers.fetch_sub(1, Ordering::SeqCst);
            }
            generation = s.generation.load(Ordering::Acquire);
        }
        seen = generation;
        if s.shutdown.load(Ordering::Acquire) {
            return;
        }
        if index as u64 >= generation % JOB_COUNT {
            continue;
        }
        // SAFETY: published before the generation bump we observed (Acquire), and kept
        // until this worker decrements `pending`.
        if let Some(job) = unsafe { *s.job.get() } {
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                claim_tasks(s, job, index + 1)
            }));
            if result.is_err() {
                s.panicked.store(true, Ordering::Relaxed);
            }
        }
        s.pending.fetch_sub(1, Ordering::Release);
    }
}

fn default_threads() -> usize {
    rlx_ir::env::Switch::NumThreads
        .value()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n >= 1)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once_on_a_valid_thread() {
        let pool = ThreadPool::new(3);
        for tasks in [0, 1, 2, 7, 100] {
            for threads in [1, 2, 3, 8] {
                let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
                let bad_thread = AtomicBool::new(false);
                let ok = pool.run(tasks, threads, &|t, thread| {
                    hits[t].fetch_add(1, Ordering::Relaxed);
                    if thread >= threads.min(pool.threads()) {
                        bad_thread.store(true, Ordering::Relaxed);
                    }
                });
                assert!(ok.is_ok());
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
                assert!(!bad_thread.load(Ordering::Relaxed));
            }
        }
    }

    #[test]
    fn jobs_of_changing_width_back_to_back_each_finish_whole() {
        // Many short jobs whose participant counts change from one to the next, on
        // more workers than cores: a worker that wakes late must not join a job it
        // was not counted in (that once left a job waiting forever).
        let pool = ThreadPool::new(12);
        for round in 0..4000 {
            let tasks = [2, 12, 3, 7][round % 4];
            let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
            pool.run(tasks, 12, &|t, _| {
                hits[t].fetch_add(1, Ordering::Relaxed);
            })
            .unwrap();
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "round {round}"
            );
        }
    }

    #[test]
    fn concurrent_callers_do_not_oversubscribe() {
        let pool = Arc::new(ThreadPool::new(2));
        let total = Arc::new(AtomicUsize::new(0));
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let (pool, total) = (pool.clone(), total.clone());
                std::thread::spawn(move || {
                    for _ in 0..200 {
                        let ok = pool.run(5, 2, &|_, _| {
                            total.fetch_add(1, Ordering::Relaxed);
                        });
                        assert!(ok.is_ok());
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().ok();
        }
        assert_eq!(total.load(Ordering::Relaxed), 4 * 200 * 5);
    }

    #[test]
    fn a_panicking_task_is_an_error_and_the_pool_keeps_working() {
        let pool = ThreadPool::new(2);
        let r = pool.run(8, 2, &|t, _| {
            if t == 5 {
                panic!("boom");
            }
        });
        assert!(r.is_err());
        let count = AtomicUsize::new(0);
        let ok = pool.run(8, 2, &|_, _| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert!(ok.is_ok());
        assert_eq!(count.load(Ordering::Relaxed), 8);
    }
}
