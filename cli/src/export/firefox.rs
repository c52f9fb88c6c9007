//! Firefox Profiler export (processed format) through `fxprof-processed-profile`.
//!
//! One process per pid, named after its executable (the one it ran last:
//! [`crate::processes::program_module`]), one
//! thread per thread record (the main thread also named after the
//! executable), samples in stream order with their timestamps. Every module
//! with resolved frames becomes a library (name, path, build id as code id and
//! debug id) with a symbol table holding the names of the addresses the
//! profile uses, and its frames are library-relative addresses, so the profile
//! opens with function names.
//!
//! Inlined functions are frames of their own above the function that contains
//! them, with the same address and library and an increasing `inlineDepth`, as
//! the Firefox Profiler represents inlining. Frames carry their source line and
//! functions their source file when the debug info has them. Frames are in
//! categories ([`stacks`]): user code, std/libc, unknown (no symbols), and
//! off-CPU. Frames without symbols and perf-map names are labels (no address).
//!
//! With `--off-cpu` or `--wall` (a recording made in off-CPU mode, FORMAT.md
//! tag 9) the samples are weighted in milliseconds (`weightType`
//! `tracing-ms`, [`samples`]): each off-CPU interval is a sample at its
//! start weighing its duration, with no CPU delta, its leaf (`[blocked:
//! futex]`, `[waiting for CPU]`) in the Off-CPU category (subcategories
//! Blocked and Waiting for CPU); with `--wall` each CPU sample weighs its
//! sampling interval beside them. Without either, off-CPU intervals are left
//! out and every sample weighs 1.
//!
//! A recording with heap events (FORMAT.md tag 10) also gives each process
//! its native allocations (the Firefox Profiler's "Native Allocations" and
//! "Retained Memory" call trees and the memory track): each sampled
//! allocation weighing the bytes it stands for, each free the negative, at
//! its time, on its allocation's stack cut to the code that allocated (the
//! allocator's own frames, inlined ones included, left off the leaf end).
//! The library keeps them in the process's first thread.
//!
//! `fxprof-processed-profile` has no inline frames or source locations, so
//! the export gives each inlined frame a unique placeholder label and fills in
//! address, depth, line, file and function in the serialized tables.

mod samples;
mod stacks;

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::rc::Rc;
use std::sync::Arc;

use fx::debugid::DebugId;
use fxprof_processed_profile as fx;
use serde_json::Value;
use spulse::{Definitions, Frame, FrameId, StackId};

use samples::WithSamples;
pub(crate) use samples::{out_of_memory, Seq};
pub use samples::{Samples, ThreadSamples};
use stacks::{InlineFrame, Leaf, Stacks, PLACEHOLDER};
pub use stacks::{BLOCKED, OFF_CPU_CATEGORY, WAITING_FOR_CPU};

use super::Job;
use crate::aggregate::aggregate;
use crate::input::{progress, PROGRESS_STEP};
use crate::select::{Context, Contexts, Selector, TimeMode};
use crate::symbolize::{module_name, Symbolizer};
use crate::CliError;

/// The processed-profile format version `fxprof-processed-profile` writes
/// (per-thread tables and string arrays).
pub const PROFILE_VERSION: u64 = 55;

/// Spool times are microseconds; the profile takes nanoseconds and milliseconds.
const NS_PER_US: u64 = 1000;
const US_PER_MS: f64 = 1000.0;

/// The Breakpad-style debug id of an ELF build id (first 16 bytes as a
/// little-endian GUID, age 0), as Firefox's symbolication expects.
fn debug_id(build_id: &[u8]) -> DebugId {
    let mut g = [0u8; 16];
    let n = build_id.len().min(16);
    g[..n].copy_from_slice(&build_id[..n]);
    g[0..4].reverse();
    g[4..6].reverse();
    g[6..8].reverse();
    DebugId::from_guid_age(&g, 0).unwrap_or_default()
}

/// The stack of a heap event without the allocator's own frames at its
/// leaf end (as the heap profile cuts them); the whole stack if nothing else
/// is left.
fn allocation_stack(defs: &Definitions, sym: &mut Symbolizer, stack: StackId) -> StackId {
    let ctx = Context { thread: None, pid: 0, perf_map_allowed: false };
    let mut at = stack;
    loop {
        let node = defs.stack(at);
        let r = sym.resolve(defs, node.frame, &ctx);
        if !crate::symbolize::is_allocator_frame(&sym.function(r.outer().func).name) {
            return at;
        }
        match node.parent {
            Some(p) => at = p,
            None => return stack,
        }
    }
}

/// Nanoseconds from `start_us` to `time_us` (0 before it).
fn ns_since(time_us: u64, start_us: u64) -> u64 {
    time_us.saturating_sub(start_us).saturating_mul(NS_PER_US)
}

/// A source file and line (0: unknown).
type SourceLine = (Option<Rc<str>>, u32);

/// The most threads a spool exported as a Firefox profile may define (see
/// [`profile`]): about 230 MB of per-thread tables.
pub const MAX_THREADS: usize = 10_000;

/// Build and write the profile of the selected samples as JSON. Samples are
/// streamed from the spool into [`Samples`] (12 bytes a sample), and each
/// thread's samples table is written from there straight to `out`.
pub fn export(job: &Job<'_>, sym: &mut Symbolizer, out: &mut dyn Write) -> Result<u64, CliError> {
    let (doc, samples, selected) = profile(job, sym)?;
    serde_json::to_writer(&mut *out, &WithSamples { doc: &doc, samples: &samples })
        .map_err(|e| job.write_error(e.into()))?;
    Ok(selected)
}

/// The processed profile (format version [`PROFILE_VERSION`]) of the
/// selected samples without its samples tables (each thread's `samples` is
/// `null`), the samples, and how many samples it holds.
pub fn profile(job: &Job<'_>, sym: &mut Symbolizer) -> Result<(Value, Samples, u64), CliError> {
    let (replay, filter, product) = (job.replay, job.filter, job.title);
    let defs: &Definitions = replay;
    let start_us = defs.start_time_us();
    let interval = fx::SamplingInterval::from_nanos(defs.interval_us().max(1).saturating_mul(NS_PER_US));
    let mut profile = fx::Profile::new(
        product,
        fx::ReferenceTimestamp::from_millis_since_unix_epoch(start_us as f64 / US_PER_MS),
        interval,
    );
    let zero = fx::Timestamp::from_millis_since_reference(0.0);
    // Source location of each library frame's address: (module, rva) -> (file, line).
    let mut lib_lines: HashMap<(usize, u32), SourceLine> = HashMap::new();

    // Libraries and their symbol tables, from the module frames the selected
    // samples use (a first, aggregating pass finds them).
    // Per thread: the threads with selected samples or waits are the
    // profile's threads.
    let agg = aggregate(replay, filter, true)?;
    let mut used: HashSet<FrameId> = HashSet::new();
    let mut with_data = vec![false; defs.threads().len()];
    for (c, stack, _) in agg.iter().chain(agg.iter_off_cpu()) {
        used.extend(defs.stack_frames(stack));
        if let Some(slot) = agg.contexts[c].thread.and_then(|t| with_data.get_mut(t.index())) {
            *slot = true;
        }
    }
    // Heap events (tag 10) the selection keeps (as below): their threads and
    // the frames of their stacks (cut to the code that allocated) too.
    let mut heap_stacks: HashMap<StackId, StackId> = HashMap::new();
    let mut select = Selector::new(filter, start_us);
    for e in defs.heap_events() {
        let s = spulse::Sample { time_us: e.time_us, thread: e.thread, stack: e.stack };
        if select.next_at(defs, &s, e.samples_before).is_none() {
            continue;
        }
        let stack = *heap_stacks.entry(e.stack).or_insert_with(|| allocation_stack(defs, sym, e.stack));
        used.extend(defs.stack_frames(stack));
        if let Some(slot) = with_data.get_mut(e.thread.index()) {
            *slot = true;
        }
    }
    if !with_data.contains(&true) {
        // Nothing selected: every thread, empty, as the spool defines them.
        with_data.fill(true);
    }
    let mut used: Vec<FrameId> = used.into_iter().collect();
    used.sort_unstable();
    let any_ctx = Context { thread: None, pid: 0, perf_map_allowed: false };
    let mut lib_symbols: HashMap<usize, Vec<fx::Symbol>> = HashMap::new();
    let mut frame_kind: HashMap<FrameId, (usize, u32)> = HashMap::new();
    for fid in used {
        let Frame::Module { module, file_relative } = defs.frame(fid) else { continue };
        let r = sym.resolve(defs, fid, &any_ctx);
        if !r.named {
            continue;
        }
        let m = defs.module(module);
        let Some(syms) = sym.module_symbols(m) else { continue };
        let Some(rva) = syms.svma(file_relative).and_then(|a| u32::try_from(a - syms.image_base).ok()) else {
            continue;
        };
        let outer = r.outer();
        lib_lines.insert((module.index(), rva), (outer.file.clone(), outer.line));
        lib_symbols.entry(module.index()).or_default().push(fx::Symbol {
            address: rva,
            size: Some(1),
            name: sym.function(outer.func).name.clone(),
        });
        frame_kind.insert(fid, (module.index(), rva));
    }
    let mut libs: HashMap<usize, fx::LibraryHandle> = HashMap::new();
    let mut libs_by_module: Vec<usize> = Vec::new();
    for (mi, symbols) in lib_symbols {
        let m = &defs.modules()[mi];
        let source = sym.module_symbols(m).map(|s| s.source.display().to_string()).unwrap_or_default();
        let name = module_name(m);
        let handle = profile.add_lib(fx::LibraryInfo {
            name: name.clone(),
            debug_name: name,
            path: m.path().display().to_string(),
            debug_path: source,
            debug_id: debug_id(&m.build_id),
            code_id: (!m.build_id.is_empty()).then(|| m.build_id_hex()),
            arch: Some(std::env::consts::ARCH.to_string()),
            symbol_table: Some(Arc::new(fx::SymbolTable::new(symbols))),
        });
        libs.insert(mi, handle);
        libs_by_module.push(mi);
    }

    // Processes (named after their executable) and threads.
    let mut exe_names: HashMap<u32, String> = HashMap::new();
    for m in defs.modules() {
        if let std::collections::hash_map::Entry::Vacant(e) = exe_names.entry(m.pid) {
            if let Some(exe) = crate::processes::program_module(defs, m.pid) {
                e.insert(module_name(exe));
            }
        }
    }
    // The format keeps tables per thread (about 23 KB each in the library
    // and the document, sampled or not): a spool of 100,000 threads of one
    // sample each ran out of memory at 2 GB, where the other formats take
    // 60 MB.
    let selected_threads = with_data.iter().filter(|&&b| b).count();
    if selected_threads > MAX_THREADS {
        return Err(CliError::input(format!(
            "{selected_threads} threads selected: the Firefox Profiler format keeps tables for each thread, and this \
             export takes at most {MAX_THREADS}; select fewer (--pid, --tid, --from/--to) or export this spool as \
             pprof, speedscope, collapsed or svg"
        )));
    }
    let mut processes: HashMap<u32, fx::ProcessHandle> = HashMap::new();
    // The first thread of each process: the library puts a process's
    // allocation samples in its table.
    let mut first_thread: HashMap<u32, (spulse::ThreadId, fx::ThreadHandle)> = HashMap::new();
    let mut threads: Vec<Option<fx::ThreadHandle>> = Vec::new();
    for t in defs.threads() {
        if !with_data[t.id.index()] {
            threads.push(None);
            continue;
        }
        let exe = exe_names.get(&t.pid).cloned();
        let process = *processes.entry(t.pid).or_insert_with(|| {
            let name = exe.clone().unwrap_or_else(|| format!("pid {}", t.pid));
            profile.add_process(&name, t.pid, zero)
        });
        let main = t.tid == t.pid;
        let th = profile.add_thread(process, t.tid, zero, main);
        first_thread.entry(t.pid).or_insert((t.id, th));
        let name = match (&exe, main) {
            (Some(exe), true) => exe.clone(),
            _ if !t.name.is_empty() => t.name.clone(),
            _ => format!("tid {}", t.tid),
        };
        profile.set_thread_name(th, &name);
        threads.push(Some(th));
    }

    let mut stacks = Stacks::new(&mut profile, frame_kind, libs);
    let time = filter.time.is_time();
    let mut select = Selector::new(filter, start_us);
    // Per-thread contexts: a stack is interned once per (context, stack), as
    // the profile's stack tables are per thread.
    let mut contexts = Contexts::new(defs, true);
    let cpu = fx::CpuDelta::from_micros(defs.interval_us());
    let mut per_thread: Vec<ThreadSamples> = threads.iter().map(|_| ThreadSamples::default()).collect();
    let samples = if filter.time == TimeMode::OffCpu { None } else { Some(replay.samples()) };
    let bar = progress(defs.sample_count(), "exporting");
    for s in samples.into_iter().flatten() {
        let s = s?;
        let n = select.read();
        if n.is_multiple_of(PROGRESS_STEP) {
            bar.set_position(n);
        }
        let Some(sel) = select.next(defs, &s) else { continue };
        let ci = contexts.id(defs, &sel);
        let ctx = contexts.get(ci);
        let Some(th) = threads[s.thread.index()] else { continue };
        let stack = stacks.intern(&mut profile, defs, sym, (ci, &ctx), th, s.stack, Leaf::Cpu);
        per_thread[s.thread.index()].push(stack, ns_since(s.time_us, start_us), time, None)?;
    }
    bar.finish_and_clear();
    let mut selected = select.selected();
    if time {
        // Off-CPU intervals, each a sample at its start weighing its
        // duration, its leaf in the off-CPU category (selected as the
        // aggregation selects them).
        // With --spread-blocked, a stackless blocked interval becomes one
        // sample per captured stack it is charged to, all at its start.
        let mut spread = filter.spread_blocked.then(|| crate::spread::Spread::new(defs, filter));
        let mut select = Selector::new(filter, start_us);
        let mut parts = Vec::new();
        for o in defs.off_cpu_intervals() {
            // (Cut to the time window.)
            let Some((sel, o)) = select.interval(defs, o) else { continue };
            let o = &o;
            if o.duration_us == 0 {
                continue;
            }
            let ci = contexts.id(defs, &sel);
            let ctx = contexts.get(ci);
            let Some(th) = threads[o.thread.index()] else { continue };
            let leaf = match o.state {
                spulse::OffCpuState::Blocked => Leaf::Blocked,
                spulse::OffCpuState::Preempted => Leaf::WaitingForCpu,
            };
            parts.clear();
            match &mut spread {
                Some(sp) => sp.charge(defs, o, |stack, d| parts.push((stack, d))),
                None => parts.push((o.stack, o.duration_us)),
            }
            for &(part, d) in &parts {
                let stack = stacks.intern(&mut profile, defs, sym, (ci, &ctx), th, part, leaf);
                per_thread[o.thread.index()].push(stack, ns_since(o.start_us, start_us), time, Some(d))?;
            }
            selected += 1;
        }
    }
    // Heap events: the process's native allocations (sizes the bytes each
    // stands for, frees negative), at their times, selected as a sample of
    // their thread and stack at that time would be. Their stacks are the
    // allocating thread's, interned in the table of the process's first
    // thread, which holds them.
    let mut select = Selector::new(filter, start_us);
    let mut allocations = Vec::new();
    for e in defs.heap_events() {
        let s = spulse::Sample { time_us: e.time_us, thread: e.thread, stack: e.stack };
        let Some(sel) = select.next_at(defs, &s, e.samples_before) else { continue };
        let Some(&(tid, th)) = first_thread.get(&sel.pid) else { continue };
        let ci = contexts.id(defs, &crate::select::Selected { thread: tid, ..sel });
        let ctx = contexts.get(ci);
        let stack = heap_stacks.get(&e.stack).copied().unwrap_or(e.stack);
        let stack = stacks.intern(&mut profile, defs, sym, (ci, &ctx), th, stack, Leaf::Allocation);
        let bytes = i64::try_from(e.bytes).unwrap_or(i64::MAX);
        allocations.push((e.time_us, th, stack, e.address, if e.freed { -bytes } else { bytes }));
    }
    // In time order (threads hand their events over in the order they made
    // them, which may differ by a little across threads).
    allocations.sort_by_key(|a| a.0);
    for (time_us, th, stack, address, size) in allocations {
        let at = fx::Timestamp::from_nanos_since_reference(ns_since(time_us, start_us));
        profile.add_allocation_sample(th, at, Some(stack), address, size);
    }
    // The samples stay out of the library's tables. To learn which index each
    // stack handle gets in the serialized stack table, each thread gets one
    // sample per stack its samples use, after one whose weight names the
    // thread (the library orders threads its own way); these are read back
    // from the document and their tables replaced.
    for (i, ts) in per_thread.iter_mut().enumerate() {
        let Some(th) = threads[i] else { continue };
        profile.add_sample(th, zero, None, cpu, i32::try_from(i + 1).unwrap_or(i32::MAX));
        for &h in &ts.handles {
            profile.add_sample(th, zero, Some(h), cpu, 1);
        }
        if let Some(order) = &mut ts.order {
            let n = ts.time_ns.len();
            order.try_reserve_exact(n).map_err(|_| out_of_memory(n))?;
            order.extend(0..n as u32);
            order.sort_by_key(|&i| ts.time_ns[i as usize]);
        }
        ts.local = HashMap::new();
    }
    profile.set_symbolicated(true);
    let mut doc = serde_json::to_value(&profile)
        .map_err(|e| CliError::other(format!("serializing the profile: {e}")))?;
    let mut samples = Samples { threads: Vec::new(), cpu_delta_us: defs.interval_us(), time };
    for th in doc.get_mut("threads").and_then(Value::as_array_mut).into_iter().flatten() {
        let Some(table) = th.get_mut("samples").map(Value::take) else { continue };
        let col = |k: &str| table.get(k).and_then(Value::as_array).map(Vec::as_slice).unwrap_or(&[]);
        let i = col("weight").first().and_then(Value::as_u64).unwrap_or(0) as usize;
        let mut ts = match per_thread.get_mut(i.wrapping_sub(1)) {
            Some(ts) => std::mem::take(ts),
            None => return Err(CliError::other("serializing the profile: a thread lost its samples")),
        };
        let index: Vec<u32> = col("stack").iter().skip(1).map(|v| v.as_u64().unwrap_or(0) as u32).collect();
        for st in &mut ts.stack {
            *st = *index
                .get(*st as usize)
                .ok_or_else(|| CliError::other("serializing the profile: a stack lost its index"))?;
        }
        ts.handles = Vec::new();
        samples.threads.push(ts);
    }
    let lib_modules = lib_modules(defs, &doc, &libs_by_module);
    if let Some(threads) = doc.get_mut("threads").and_then(Value::as_array_mut) {
        for th in threads {
            fill_in_thread(th, sym, &stacks.inline_frames, &lib_lines, &lib_modules);
        }
    }
    Ok((doc, samples, selected))
}

/// The module of each entry of the profile's `libs` array (matched by path
/// and code id; modules with equal path and build id have equal symbols).
fn lib_modules(defs: &Definitions, doc: &Value, libs_by_module: &[usize]) -> Vec<Option<usize>> {
    let mut by_key: HashMap<(String, String), usize> = HashMap::new();
    for &mi in libs_by_module {
        let m = &defs.modules()[mi];
        by_key.entry((m.path().display().to_string(), m.build_id_hex())).or_insert(mi);
    }
    let libs = doc.get("libs").and_then(Value::as_array).map(Vec::as_slice).unwrap_or(&[]);
    libs.iter()
        .map(|l| {
            let path = l.get("path").and_then(Value::as_str).unwrap_or("").to_string();
            let code = l.get("codeId").and_then(Value::as_str).unwrap_or("").to_string();
            by_key.get(&(path, code)).copied()
        })
        .collect()
}

/// Fill in one serialized thread: placeholder frames become inlined frames
/// (address, library, inline depth, line, and the function, shared with every
/// other frame of the same function and library); library frames get their
/// line; functions get their source file.
fn fill_in_thread(
    th: &mut Value,
    sym: &Symbolizer,
    inline_frames: &[InlineFrame],
    lib_lines: &HashMap<(usize, u32), SourceLine>,
    lib_modules: &[Option<usize>],
) {
    let Some(th) = th.as_object_mut() else { return };
    let mut strings: Vec<Value> = match th.get_mut("stringArray").map(Value::take) {
        Some(Value::Array(a)) => a,
        _ => return,
    };
    let mut string_index: HashMap<String, usize> =
        strings.iter().enumerate().filter_map(|(i, s)| Some((s.as_str()?.to_string(), i))).collect();
    let mut intern = |strings: &mut Vec<Value>, s: &str| {
        *string_index.entry(s.to_string()).or_insert_with(|| {
            strings.push(Value::from(s));
            strings.len() - 1
        })
    };
    let as_idx = |v: &Value| v.as_u64().map(|n| n as usize);
    // Resource index <-> module.
    let res_libs: Vec<Option<usize>> = th
        .get("resourceTable")
        .and_then(|r| r.get("lib"))
        .and_then(Value::as_array)
        .map(|a| a.iter().map(|l| as_idx(l).and_then(|l| lib_modules.get(l).copied().flatten())).collect())
        .unwrap_or_default();
    let module_res: HashMap<usize, usize> =
        res_libs.iter().enumerate().filter_map(|(r, m)| Some(((*m)?, r))).collect();

    let mut ft = th.remove("frameTable").unwrap_or(Value::Null);
    let mut fn_ = th.remove("funcTable").unwrap_or(Value::Null);
    let col = |t: &Value, k: &str| t.get(k).and_then(Value::as_array).cloned().unwrap_or_default();
    let mut f_addr = col(&ft, "address");
    let mut f_depth = col(&ft, "inlineDepth");
    let mut f_line = col(&ft, "line");
    let mut f_func = col(&ft, "func");
    let mut f_native = col(&ft, "nativeSymbol");
    let mut u_name = col(&fn_, "name");
    let mut u_res = col(&fn_, "resource");
    let mut u_file = col(&fn_, "fileName");
    let n_frames = f_func.len();
    if [f_addr.len(), f_depth.len(), f_line.len(), f_native.len()].iter().any(|&l| l != n_frames)
        || [u_res.len(), u_file.len()].iter().any(|&l| l != u_name.len())
    {
        // Not the layout this code knows: leave the thread as serialized.
        th.insert("frameTable".into(), ft);
        th.insert("funcTable".into(), fn_);
        th.insert("stringArray".into(), Value::Array(strings));
        return;
    }
    // Functions by (name, resource), to share one function between the
    // library frames and the inlined frames of the same function.
    let mut funcs: HashMap<(usize, Option<usize>), usize> = HashMap::new();
    for (i, (n, r)) in u_name.iter().zip(&u_res).enumerate() {
        if let Some(n) = as_idx(n) {
            let is_placeholder =
                strings.get(n).and_then(Value::as_str).is_some_and(|s| s.starts_with(PLACEHOLDER));
            if !is_placeholder {
                funcs.entry((n, as_idx(r))).or_insert(i);
            }
        }
    }
    // The native symbol of each (resource, address) library frame.
    let mut natives: HashMap<(Option<usize>, u64), Value> = HashMap::new();
    for i in 0..n_frames {
        let Some(f) = as_idx(&f_func[i]) else { continue };
        let name = as_idx(&u_name[f]).and_then(|n| strings.get(n)).and_then(Value::as_str).unwrap_or("");
        if let Some(k) = name.strip_prefix(PLACEHOLDER).and_then(|k| k.parse::<usize>().ok()) {
            let Some(inl) = inline_frames.get(k) else { continue };
            let res = module_res.get(&inl.module).copied();
            let real = intern(&mut strings, &sym.function(inl.func).name);
            let func = *funcs.entry((real, res)).or_insert_with(|| {
                // The placeholder's own function becomes this function.
                u_name[f] = Value::from(real);
                u_res[f] = res.map(Value::from).unwrap_or(Value::from(-1));
                f
            });
            if u_file[func].is_null() {
                if let Some(file) = &inl.file {
                    u_file[func] = Value::from(intern(&mut strings, file));
                }
            }
            f_func[i] = Value::from(func);
            f_addr[i] = Value::from(inl.rva);
            f_depth[i] = Value::from(inl.depth);
            f_line[i] = if inl.line > 0 { Value::from(inl.line) } else { Value::Null };
            f_native[i] = Value::Null;
        } else if let Some(addr) = f_addr[i].as_u64() {
            let res = as_idx(&u_res[f]);
            let module = res.and_then(|r| res_libs.get(r).copied().flatten());
            natives.insert((res, addr), f_native[i].clone());
            if let Some((file, line)) = module.and_then(|m| lib_lines.get(&(m, addr as u32))) {
                if *line > 0 {
                    f_line[i] = Value::from(*line);
                }
                if let (Some(file), true) = (file, u_file[f].is_null()) {
                    u_file[f] = Value::from(intern(&mut strings, file));
                }
            }
        }
    }
    // Inlined frames share the native symbol of the library frame at their address.
    for i in 0..n_frames {
        if f_depth[i].as_u64().unwrap_or(0) > 0 {
            let res = as_idx(&f_func[i]).and_then(|f| as_idx(&u_res[f]));
            if let (Some(addr), true) = (f_addr[i].as_u64(), f_native[i].is_null()) {
                if let Some(n) = natives.get(&(res, addr)) {
                    f_native[i] = n.clone();
                }
            }
        }
    }
    // Placeholder strings are no longer referenced: blank them.
    for s in strings.iter_mut() {
        if s.as_str().is_some_and(|t| t.starts_with(PLACEHOLDER)) {
            *s = Value::from("");
        }
    }
    let set = |t: &mut Value, k: &str, v: Vec<Value>| {
        if let Some(o) = t.as_object_mut() {
            o.insert(k.to_string(), Value::Array(v));
        }
    };
    set(&mut ft, "address", f_addr);
    set(&mut ft, "inlineDepth", f_depth);
    set(&mut ft, "line", f_line);
    set(&mut ft, "func", f_func);
    set(&mut ft, "nativeSymbol", f_native);
    set(&mut fn_, "name", u_name);
    set(&mut fn_, "resource", u_res);
    set(&mut fn_, "fileName", u_file);
    th.insert("frameTable".into(), ft);
    th.insert("funcTable".into(), fn_);
    th.insert("stringArray".into(), Value::Array(strings));
}
