//! `/proc/self/maps`: where the main thread's stack is.

/// The main thread's stack top and the span below it proven to be stack.
pub(crate) fn main_stack_bounds() -> (u64, u64) {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else { return (0, 0) };
    let mut prev_end = 0u64;
    for line in maps.lines() {
        let range = line.split_whitespace().next().unwrap_or("");
        let (a, b) = range.split_once('-').unwrap_or(("", ""));
        let (Ok(start), Ok(end)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) else { continue };
        if line.ends_with("[stack]") {
            let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
            // SAFETY: getrlimit writes the struct we pass.
            unsafe { libc::getrlimit(libc::RLIMIT_STACK, &mut rl) };
            let limit = if rl.rlim_cur == libc::RLIM_INFINITY { 1u64 << 30 } else { rl.rlim_cur };
            let span = (end - prev_end.min(start)).min(limit.max(end - start));
            return (end, span);
        }
        prev_end = end;
    }
    (0, 0)
}
