//! Software prefetch hints, for access patterns the hardware prefetcher misses
//! (many short streams, or reads that start where no stream has been seen).

/// Asks for the cache lines of `bytes` bytes from `at` (a hint: it never faults,
/// wherever `at` points, and does nothing off x86-64).
#[inline(always)]
pub(crate) fn lines(at: *const u8, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    for offset in (0..bytes).step_by(64) {
        // SAFETY: a prefetch reads nothing architecturally and never faults.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                at.wrapping_add(offset).cast::<i8>(),
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (at, bytes);
}
