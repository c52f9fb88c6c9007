//! Memory for readers of untrusted files: a zeroed buffer whose allocation
//! failure is an error (the length comes from the file), and the huge-page
//! advice for large sample columns.

pub(super) fn no_memory(len: usize) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::OutOfMemory,
        format!(
            "cannot allocate {len} bytes to read the file into memory (Replay reads it with bounded memory)"
        ),
    )
}

/// A zero-filled buffer of `len` bytes, like `vec![0u8; len]` (the allocator
/// hands out fresh zeroed pages without writing them), but an error instead of
/// an abort when the memory cannot be had: the length comes from an untrusted
/// file (a sparse file can claim terabytes).
pub(crate) fn zeroed_buffer(len: usize) -> std::io::Result<Vec<u8>> {
    if len == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u8>(len).map_err(|_| no_memory(len))?;
    // SAFETY: `layout` has a non-zero size (`len > 0`).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return Err(no_memory(len));
    }
    // SAFETY: `ptr` was allocated by the global allocator with `layout`, which
    // is the layout of a `Vec<u8>` of capacity `len` (size `len`, alignment 1),
    // and all `len` bytes are initialized (zeroed); the Vec takes ownership.
    Ok(unsafe { Vec::from_raw_parts(ptr, len, len) })
}

/// Ask the kernel to back a large column with transparent huge pages: filling
/// 10 bytes per sample otherwise costs one page fault per 4 KiB, which is a
/// large share of the time to load a big spool. Purely advisory.
pub(crate) fn advise_huge_pages<T>(v: &mut Vec<T>) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let bytes = v.capacity() * std::mem::size_of::<T>();
        if bytes < 4 * HUGE {
            return;
        }
        let start = v.as_mut_ptr() as usize;
        let aligned = (start + HUGE - 1) & !(HUGE - 1);
        let end = (start + bytes) & !(HUGE - 1);
        if end > aligned {
            // [aligned, end) lies inside the vector's own allocation (its
            // capacity), which stays alive and unmoved for this call;
            // MADV_HUGEPAGE only changes how the kernel backs those pages, never
            // their contents. Failure (e.g. no THP support) is harmless.
            // SAFETY: a range of our own live allocation; advice only, so no
            // Rust invariant can be affected.
            unsafe {
                libc::madvise(aligned as *mut libc::c_void, end - aligned, libc::MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = v;
}
