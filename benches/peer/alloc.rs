//! A counting global allocator for the load benches: how many allocations
//! (`alloc`, `alloc_zeroed`, `realloc`) the process made, to divide by the
//! requests served.
//!
//! Each thread counts in a thread-local cell and adds its count to the
//! process total every [`FLUSH`] allocations, so the count costs no
//! contended atomic per allocation; [`allocations`] is exact to within
//! `FLUSH` per thread, nothing against the hundreds of thousands of
//! requests a run serves.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

/// The system allocator, counted.
pub struct Counting;

/// Allocations flushed to the process total.
static TOTAL: AtomicU64 = AtomicU64::new(0);

/// A thread adds its count to [`TOTAL`] every this many allocations.
const FLUSH: u64 = 64;

thread_local! {
    // `const` and without `Drop`: no lazy initialisation, no allocation,
    // safe to touch from inside the allocator.
    static LOCAL: Cell<u64> = const { Cell::new(0) };
}

#[inline]
fn count() {
    // `try_with`: a thread being torn down has no cell any more.
    let _ = LOCAL.try_with(|c| {
        let n = c.get() + 1;
        if n >= FLUSH {
            TOTAL.fetch_add(n, Ordering::Relaxed);
            c.set(0);
        } else {
            c.set(n);
        }
    });
}

/// Allocations so far in this process (to within [`FLUSH`] per thread).
pub fn allocations() -> u64 {
    TOTAL.load(Ordering::Relaxed)
}

// SAFETY: every call is forwarded unchanged to `System`; counting touches
// only a thread-local `Cell` and an atomic, and never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` with `layout` (all our calls
        // forward to it).
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: as for `dealloc`, and the caller upholds `realloc`'s
        // contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}
