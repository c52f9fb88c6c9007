//! `spulse info`: what a spool or packed file holds (container, header,
//! duration, counts, threads, modules), as text or as one JSON object.

use std::collections::{BTreeSet, HashMap};

use clap::Args;
use serde_json::json;

use super::{format_unix_us, with_stdout, InputArgs};
use crate::display::escape;
use crate::input::{open_inputs, progress, PROGRESS_STEP};
use crate::processes::processes;
use crate::symbolize::module_name;
use crate::CliError;

/// Arguments of `spulse info`.
#[derive(Debug, Args)]
#[command(
    after_help = "Examples:\n  spulse info app.spool\n  spulse info app.spool --json | jq .samples\n  spulse info app-1234-*.spool    (the segments of a rotating recording, merged)\n\nSeveral files are described as one recording; the sizes are then their total\n(file bytes) and the merged stream's (valid bytes, bytes/sample)."
)]
pub struct InfoArgs {
    #[command(flatten)]
    pub input: InputArgs,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Run `spulse info`.
pub fn run(args: &InfoArgs) -> Result<(), CliError> {
    let inputs = open_inputs(&args.input.files)?;
    let replay = &inputs.replay;
    let defs = replay.definitions();
    let file_len = match args.input.files.as_slice() {
        [one] => std::fs::metadata(one).map(|m| m.len()).unwrap_or(replay.valid_len()),
        several => several.iter().map(|f| std::fs::metadata(f).map_or(0, |m| m.len())).sum(),
    };

    // What the recorders said did not go as configured (`<spool>.warnings`,
    // written beside the spool only when there were any; bounded read).
    let mut recorder_warnings: Vec<String> = Vec::new();
    for f in &args.input.files {
        if let Some(text) = read_warnings(&spulse::warnings_path(f)) {
            recorder_warnings
                .extend(text.lines().filter(|l| !l.trim().is_empty()).take(64).map(str::to_string));
        }
    }

    let bar = progress(defs.sample_count(), "reading");
    let mut per_thread: Vec<u64> = vec![0; defs.threads().len()];
    // Samples whose leaf is a kernel-mode frame: system CPU time.
    let kernel_frame: Vec<bool> =
        defs.frames().iter().map(|f| matches!(f, spulse::Frame::Absolute { kernel: true, .. })).collect();
    let mut kernel_samples = 0u64;
    let (mut first, mut last) = (u64::MAX, 0u64);
    let mut n = 0u64;
    for s in replay.samples() {
        let s = s?;
        per_thread[s.thread.index()] += 1;
        if kernel_frame.get(defs.stack(s.stack).frame.index()).copied().unwrap_or(false) {
            kernel_samples += 1;
        }
        first = first.min(s.time_us);
        last = last.max(s.time_us);
        n += 1;
        if n.is_multiple_of(PROGRESS_STEP) {
            bar.set_position(n);
        }
    }
    bar.finish_and_clear();
    let samples = n;
    let off = OffCpuSummary::of(defs);
    let heap = HeapSummary::of(defs);
    // To the last sample or the end of the last off-CPU wait (a recording
    // of a process that only waited has no sample).
    let end_us = if samples > 0 { last.max(off.end_us) } else { off.end_us };
    let duration_us = end_us.saturating_sub(defs.start_time_us());
    let generations: BTreeSet<u64> = defs.modules().iter().map(|m| m.generation).collect();
    let deactivated: HashMap<u32, u64> =
        defs.deactivations().iter().map(|d| (d.module.get(), d.samples_before)).collect();
    let procs = processes(defs, &per_thread);
    let bytes_per_sample = if samples > 0 { replay.valid_len() as f64 / samples as f64 } else { 0.0 };
    // A packed file's compression ratio: its samples as decoded columns (16
    // bytes each) over the LZ4 blocks that hold them.
    let packed = replay.packed_stats();
    let ratio = packed.map(|p| p.column_bytes as f64 / p.compressed_bytes.max(1) as f64);

    if args.json {
        let threads: Vec<_> = defs
            .threads()
            .iter()
            .map(|t| json!({"pid": t.pid, "tid": t.tid, "name": t.name, "samples": per_thread[t.id.index()]}))
            .collect();
        let modules: Vec<_> = defs
            .modules()
            .iter()
            .map(|m| {
                json!({
                    "id": m.id.get(), "pid": m.pid, "path": String::from_utf8_lossy(&m.path),
                    "start": m.start, "size": m.size, "file_offset": m.file_offset,
                    "generation": m.generation, "build_id": m.build_id_hex(),
                    "active": defs.is_module_active(m.id),
                    "deactivated_after_samples": deactivated.get(&m.id.get()),
                })
            })
            .collect();
        let process_list: Vec<_> = procs
            .iter()
            .map(|p| json!({"pid": p.pid, "program": p.program, "samples": p.samples, "threads": p.threads, "ended": p.ended}))
            .collect();
        let v = json!({
            "file": args.input.files[0].display().to_string(),
            "files": args.input.files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>(),
            "file_bytes": file_len,
            "container": if packed.is_some() { "packed" } else { "spool" },
            "packed_blocks": packed.map(|p| p.blocks),
            "compression_ratio": ratio,
            "valid_bytes": replay.valid_len(),
            "start_time_us": defs.start_time_us(),
            "interval_us": defs.interval_us(),
            "duration_us": duration_us,
            "first_sample_us": (samples > 0).then_some(first),
            "last_sample_us": (samples > 0).then_some(last),
            "samples": samples,
            "kernel_samples": kernel_samples,
            "threads": defs.threads().len(),
            "processes": procs.len(),
            "processes_with_samples": procs.iter().filter(|p| p.samples > 0).count(),
            "modules": defs.modules().len(),
            "module_generations": generations.len(),
            "deactivated_modules": deactivated.len(),
            "frames": defs.frames().len(),
            "stacks": defs.stack_count(),
            "python_runtime_transitions": defs.python_runtime_events().len(),
            "off_cpu": off.intervals > 0,
            "off_cpu_intervals": off.intervals,
            "off_cpu_blocked_us": off.blocked_us,
            "off_cpu_blocked_with_stack_us": off.with_stack_us,
            "off_cpu_waiting_for_cpu_us": off.preempted_us,
            "heap_events": heap.allocations + heap.frees,
            "heap_allocated_bytes": heap.allocated,
            "heap_freed_bytes": heap.freed,
            "bytes_per_sample": bytes_per_sample,
            "recorder_warnings": recorder_warnings,
            "recovered_from_truncated_tail": replay.recovered_from_truncated_tail(),
            "process_list": process_list,
            "thread_list": threads,
            "module_list": modules,
        });
        return with_stdout(|out| writeln!(out, "{}", serde_json::to_string_pretty(&v).expect("json")));
    }

    with_stdout(|out| {
        if let [one] = args.input.files.as_slice() {
            writeln!(
                out,
                "file:            {} ({file_len} bytes, {} valid)",
                escape(&one.display().to_string()),
                replay.valid_len()
            )?;
        } else {
            writeln!(
                out,
                "files:           {} spools merged in time order ({file_len} bytes; {} merged)",
                args.input.files.len(),
                replay.valid_len()
            )?;
            for f in &args.input.files {
                writeln!(out, "                 {}", escape(&f.display().to_string()))?;
            }
        }
        match (packed, ratio) {
            (Some(p), Some(r)) => writeln!(
                out,
                "container:       packed, {} block(s), compression ratio {r:.2} ({} bytes of sample \
                 columns in {} bytes of LZ4)",
                p.blocks, p.column_bytes, p.compressed_bytes
            )?,
            _ => writeln!(out, "container:       spool")?,
        }
        writeln!(
            out,
            "start:           {} ({} us)",
            format_unix_us(defs.start_time_us()),
            defs.start_time_us()
        )?;
        writeln!(out, "interval:        {} us", defs.interval_us())?;
        // The spool header is only the start time and the requested interval:
        // which engine ran is reported by the recorder's `Stats`, not the file.
        writeln!(out, "engine:          not recorded in the spool")?;
        writeln!(out, "duration:        {:.3} s (start to last sample or wait)", duration_us as f64 / 1e6)?;
        writeln!(out, "samples:         {samples}")?;
        // The file cannot say whether system time was sampled: the recorder's
        // `Stats::kernel_time` does. What follows from the samples is stated.
        if kernel_samples > 0 {
            writeln!(
                out,
                "kernel time:     {kernel_samples} sample(s) ({:.1}%) in the kernel, shown as [kernel] on top \
                 of the user stack that entered it",
                100.0 * kernel_samples as f64 / samples as f64
            )?;
        } else {
            writeln!(
                out,
                "kernel time:     no sample in the kernel: either no system time was spent, or the recorder \
                 sampled user time only (switched off, refused by the kernel, or a timer engine, which \
                 counts system time without marking it); the spool does not say which, the recorder's \
                 Stats::kernel_time does"
            )?;
        }
        if heap.allocations + heap.frees > 0 {
            writeln!(
                out,
                "heap:            {} sampled allocation(s) standing for {:.1} MiB allocated, {:.1} MiB of it freed \
                 while recording ({} free(s)); see export --format firefox (Native Allocations, Retained Memory)",
                heap.allocations,
                heap.allocated as f64 / (1 << 20) as f64,
                heap.freed as f64 / (1 << 20) as f64,
                heap.frees
            )?;
        }
        if off.intervals == 0 {
            // The spool has no record of the mode itself: a recording with
            // it whose events the program closed at once has no interval either.
            writeln!(
                out,
                "off-CPU:         none in the spool: recorded without the off-CPU mode (spulse record \
                 --off-cpu, SPULSE_OFF_CPU=1), or with it and no wait was written (the warnings say why if the \
                 mode stopped, such as the program closing its descriptors)"
            )?;
        } else {
            writeln!(
                out,
                "off-CPU:         on: {} interval(s), {:.3} s blocked ({:.1}% with the stack it blocked in), {:.3} s waiting for a CPU; see top --off-cpu or --wall",
                off.intervals,
                off.blocked_us as f64 / 1e6,
                100.0 * off.with_stack_us as f64 / off.blocked_us.max(1) as f64,
                off.preempted_us as f64 / 1e6
            )?;
            if off.with_stack_us < off.blocked_us {
                writeln!(
                    out,
                    "                 {:.3} s without a stack ([blocked], [blocked, under 5 ms]): the thread woke before the recorder's next tick saw it blocked, or its process was stopped (SIGSTOP, a debugger: the recorder's thread stops with it), or its stack could not be read (a warning below says so); `top --off-cpu --spread-blocked` estimates where it went from the waits with a stack",
                    (off.blocked_us - off.with_stack_us) as f64 / 1e6
                )?;
            }
        }
        if recorder_warnings.is_empty() {
            writeln!(out, "warnings:        none recorded beside the spool")?;
        }
        for w in &recorder_warnings {
            writeln!(out, "warning:         {}", escape(w))?;
        }
        // Every process the table below lists; a process with no thread was
        // recorded but never sampled (it ran for less than a sampling period).
        let sampled = procs.iter().filter(|p| p.samples > 0).count();
        writeln!(
            out,
            "processes:       {} ({} with samples); threads: {}",
            procs.len(),
            sampled,
            defs.threads().len()
        )?;
        writeln!(
            out,
            "modules:         {} ({} generation(s), {} deactivated)",
            defs.modules().len(),
            generations.len(),
            deactivated.len()
        )?;
        writeln!(out, "frames:          {}", defs.frames().len())?;
        writeln!(out, "stacks:          {}", defs.stack_count())?;
        writeln!(out, "python runtime:  {} transition(s)", defs.python_runtime_events().len())?;
        writeln!(out, "bytes/sample:    {bytes_per_sample:.2}")?;
        writeln!(
            out,
            "truncated tail:  {}",
            if replay.recovered_from_truncated_tail() { "yes (recovered)" } else { "no" }
        )?;
        if !procs.is_empty() {
            writeln!(out, "\n{:>8} {:>10} {:>7} {:>5}  PROGRAM", "PID", "SAMPLES", "THREADS", "ENDED")?;
            for p in &procs {
                writeln!(
                    out,
                    "{:>8} {:>10} {:>7} {:>5}  {}",
                    p.pid,
                    p.samples,
                    p.threads,
                    if p.ended { "yes" } else { "no" },
                    escape(&p.program)
                )?;
            }
        }
        if !defs.threads().is_empty() {
            writeln!(out, "\n{:>8} {:>8} {:>10}  NAME", "PID", "TID", "SAMPLES")?;
            for t in defs.threads() {
                writeln!(
                    out,
                    "{:>8} {:>8} {:>10}  {}",
                    t.pid,
                    t.tid,
                    per_thread[t.id.index()],
                    escape(&t.name)
                )?;
            }
        }
        if !defs.modules().is_empty() {
            writeln!(
                out,
                "\n{:>4} {:>4} {:>18} {:>10} {:>4}  {:<8} MODULE",
                "ID", "GEN", "START", "SIZE", "ACT", "BUILD-ID"
            )?;
            for m in defs.modules() {
                let bid = m.build_id_hex();
                writeln!(
                    out,
                    "{:>4} {:>4} {:>#18x} {:>10} {:>4}  {:<8} {} ({})",
                    m.id.get(),
                    m.generation,
                    m.start,
                    m.size,
                    if defs.is_module_active(m.id) { "yes" } else { "no" },
                    if bid.is_empty() { "-" } else { &bid[..bid.len().min(8)] },
                    escape(&module_name(m)),
                    escape(&m.path().display().to_string())
                )?;
            }
        }
        Ok(())
    })
}

/// The text of a warnings file: a regular file (not followed through a
/// symlink, not a FIFO), at most 64 KiB of it; `None` if there is none.
fn read_warnings(path: &std::path::Path) -> Option<String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    if !f.metadata().ok()?.is_file() {
        return None;
    }
    let mut buf = Vec::new();
    f.take(64 << 10).read_to_end(&mut buf).ok()?;
    Some(String::from_utf8_lossy(&buf).into_owned())
}

/// What the heap events of a spool add up to (FORMAT.md, tag 10).
struct HeapSummary {
    allocations: u64,
    frees: u64,
    /// Bytes the allocations stand for.
    allocated: u64,
    /// Bytes the frees stand for.
    freed: u64,
}

impl HeapSummary {
    fn of(defs: &spulse::Definitions) -> HeapSummary {
        let mut s = HeapSummary { allocations: 0, frees: 0, allocated: 0, freed: 0 };
        for e in defs.heap_events() {
            if e.freed {
                s.frees += 1;
                s.freed = s.freed.saturating_add(e.bytes);
            } else {
                s.allocations += 1;
                s.allocated = s.allocated.saturating_add(e.bytes);
            }
        }
        s
    }
}

/// What the off-CPU intervals of a spool add up to (FORMAT.md, tag 9).
struct OffCpuSummary {
    intervals: usize,
    blocked_us: u64,
    /// Blocked time whose stack is more than its label (the stack was read).
    with_stack_us: u64,
    preempted_us: u64,
    /// The latest end of an interval (unix us; 0: none).
    end_us: u64,
}

impl OffCpuSummary {
    fn of(defs: &spulse::Definitions) -> OffCpuSummary {
        let mut s =
            OffCpuSummary { intervals: 0, blocked_us: 0, with_stack_us: 0, preempted_us: 0, end_us: 0 };
        for o in defs.off_cpu_intervals() {
            s.intervals += 1;
            s.end_us = s.end_us.max(o.start_us.saturating_add(o.duration_us));
            match o.state {
                spulse::OffCpuState::Preempted => {
                    s.preempted_us = s.preempted_us.saturating_add(o.duration_us)
                }
                spulse::OffCpuState::Blocked => {
                    s.blocked_us = s.blocked_us.saturating_add(o.duration_us);
                    if defs.stack(o.stack).parent.is_some() {
                        s.with_stack_us = s.with_stack_us.saturating_add(o.duration_us);
                    }
                }
            }
        }
        s
    }
}
