//! Gives back to the operating system the heap that glibc keeps after a burst.
//!
//! Thousands of ADS streams syncing at once build their first responses together (up to
//! [`crate::xds::ordering::RESPONSE_BUDGET_BYTES`] of resources each) and free them a
//! moment later. glibc's malloc keeps freed memory in its arenas, so RSS stays near the
//! burst's peak: with 1,000 streams synced, RSS per idle stream measured about twice
//! what the streams hold. Every [`CHECK`] this task compares RSS with the heap in use,
//! and when the difference has grown by [`HELD_FREE_LIMIT`] since the last trim, trims
//! (`malloc_trim`, on a blocking thread).
//!
//! Invariant: it only returns memory nothing uses; it never fails and never stops the
//! process. On a libc other than glibc it does nothing.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// How often the free memory glibc holds is looked at.
pub(crate) const CHECK: Duration = Duration::from_secs(1);

/// Growth of the free heap held past which it is given back.
pub(crate) const HELD_FREE_LIMIT: usize = 16 << 20;

/// Resident memory the heap does not use: RSS less the bytes glibc has handed out, from
/// its arenas and mapped on their own (code, stacks and fragments are in it too, so only
/// its growth means something). `None` where that cannot be known.
pub(crate) fn held_free() -> Option<usize> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
        let pages: usize = statm.split_whitespace().nth(1)?.parse().ok()?;
        // SAFETY: sysconf and mallinfo2 only read (mallinfo2: glibc ≥ 2.33).
        let (page, info) = unsafe { (libc::sysconf(libc::_SC_PAGESIZE), libc::mallinfo2()) };
        // In use: from the arenas, and mapped on its own (large blocks).
        let in_use = info.uordblks.saturating_add(info.hblkhd);
        Some((pages * usize::try_from(page).ok()?).saturating_sub(in_use))
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        None
    }
}

/// Gives free heap back to the operating system.
pub(crate) fn trim() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim releases free memory only; it takes glibc's own locks.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Trims once at the first check (start-up's first build is a burst too), then whenever
/// [`held_free`] has grown by more than [`HELD_FREE_LIMIT`] since the last trim left it
/// (what a trim cannot give back is not trimmed again and again). Returns on shutdown.
pub(crate) async fn give_back(shutdown: CancellationToken) {
    if held_free().is_none() {
        // Nothing to do here; a task of the runtime ends only at shutdown.
        shutdown.cancelled().await;
        return;
    }
    let mut tick = tokio::time::interval(CHECK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    let mut floor: Option<usize> = None;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        // Unknown this time (no file descriptor for /proc, say): try again next time.
        // mallinfo2 takes each arena's lock: off the async workers, as the trim.
        let Ok(Some(free)) = tokio::task::spawn_blocking(held_free).await else {
            continue;
        };
        if floor.is_some_and(|f| free <= f.saturating_add(HELD_FREE_LIMIT)) {
            floor = floor.map(|f| f.min(free));
            continue;
        }
        let after = tokio::task::spawn_blocking(|| {
            trim();
            held_free()
        })
        .await;
        floor = after.ok().flatten().or(Some(free));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A burst freed is held by glibc, and a trim gives it back: what [`held_free`]
    /// reports drops. Counted by the kernel and glibc, not by timing.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn a_freed_burst_is_given_back() {
        // A burst of blocks under the mmap threshold, written (so resident), then every
        // other one freed: the blocks kept pin the holes, so free() alone cannot give
        // them back (as with a sync burst among long-lived allocations).
        let mut blocks: Vec<Vec<u8>> = (0..8192).map(|i| vec![i as u8; 16 << 10]).collect();
        let mut kept = Vec::new();
        for (i, b) in blocks.drain(..).enumerate() {
            if i % 2 == 0 {
                kept.push(b);
            }
        }
        let before = held_free().unwrap();
        assert!(before > 48 << 20, "the freed holes are held: {before}");
        trim();
        let after = held_free().unwrap();
        assert!(
            after + (32 << 20) < before,
            "trimmed {before} -> {after} ({} kept)",
            kept.len()
        );
    }
}
