//! Memory handed back to the system after a burst.
//!
//! mimalloc (the global allocator) returns a thread's freed pages only as that thread goes on
//! allocating; an edge thread that served 2,000 connections and then goes quiet keeps them, and
//! RSS stays at the burst's peak. Each thread that serves asks for it now and then.
#![allow(unsafe_code)] // one foreign call, with no preconditions

/// How often the free pages are returned, in pool sweeps (one a second).
pub(crate) const COLLECT_EVERY_SWEEPS: u32 = 10;

/// Returns the calling thread's free pages (and abandoned ones) to the system.
pub(crate) fn return_free_pages() {
    // SAFETY: mi_collect only walks the allocator's own structures; it has no preconditions.
    unsafe { libmimalloc_sys::mi_collect(true) }
}
