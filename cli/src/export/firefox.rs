//! Firefox Profiler export (processed format) through `fxprof-processed-profile`.
//!
//! One process per pid, one thread per thread record, samples in stream order
//! with their timestamps. Every module with resolved frames becomes a library
//! (name, path, build id as code id and debug id) with a symbol table holding
//! the names of the addresses the profile uses, and its frames are
//! library-relative addresses, so the profile opens with function names.
//! Inlined functions are added as label frames above the function that contains
//! them; frames without symbols and perf-map names are labels too.

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::sync::Arc;

use fx::debugid::DebugId;
use fxprof_processed_profile as fx;
use spulse::{Definitions, Frame, FrameId, Replay, StackId, ThreadId};

use crate::aggregate::{aggregate, Context, Filter};
use crate::input::progress;
use crate::symbolize::{module_name, Symbolizer};
use crate::CliError;

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

/// What a resolved frame becomes in the Firefox profile.
enum FxFrame {
    /// Library-relative address, and the inlined functions (outermost first) as labels.
    Lib(fx::LibraryHandle, u32, Vec<u32>),
    /// Only labels (outermost first).
    Labels(Vec<u32>),
}

/// Build and write the profile. Samples are streamed from `replay`; the Firefox
/// format itself keeps one entry per sample.
pub fn write(
    replay: &Replay,
    filter: &Filter,
    sym: &mut Symbolizer,
    product: &str,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let defs: &Definitions = replay;
    let start_us = defs.start_time_us();
    let interval = fx::SamplingInterval::from_nanos(defs.interval_us().max(1).saturating_mul(1000));
    let mut profile = fx::Profile::new(
        product,
        fx::ReferenceTimestamp::from_millis_since_unix_epoch(start_us as f64 / 1000.0),
        interval,
    );
    let zero = fx::Timestamp::from_millis_since_reference(0.0);

    // Libraries and their symbol tables, from the module frames the selected
    // samples use (a first, aggregating pass finds them).
    let agg = aggregate(replay, filter, false)?;
    let mut used: HashSet<FrameId> = HashSet::new();
    for (_, stack, _) in agg.iter() {
        used.extend(defs.stack_frames(stack));
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
        let outer = r.frames.last().expect("resolved frames are never empty").func;
        lib_symbols.entry(module.index()).or_default().push(fx::Symbol {
            address: rva,
            size: Some(1),
            name: sym.function(outer).name.clone(),
        });
        frame_kind.insert(fid, (module.index(), rva));
    }
    let mut libs: HashMap<usize, fx::LibraryHandle> = HashMap::new();
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
    }

    // Processes and threads.
    let mut processes: HashMap<u32, fx::ProcessHandle> = HashMap::new();
    let mut threads: Vec<fx::ThreadHandle> = Vec::new();
    for t in defs.threads() {
        let process = *processes
            .entry(t.pid)
            .or_insert_with(|| profile.add_process(&format!("pid {}", t.pid), t.pid, zero));
        let th = profile.add_thread(process, t.tid, zero, t.tid == t.pid);
        if !t.name.is_empty() {
            profile.set_thread_name(th, &t.name);
        } else {
            profile.set_thread_name(th, &format!("tid {}", t.tid));
        }
        threads.push(th);
    }

    let from = filter.from_us.map(|f| start_us.saturating_add(f));
    let to = filter.to_us.map(|t| start_us.saturating_add(t));
    let has_python = !defs.python_runtime_events().is_empty();
    let events = defs.python_runtime_events();
    let mut next_event = 0usize;
    let mut inside: HashMap<u32, bool> = events.iter().map(|e| (e.pid, false)).collect();

    let mut stacks: HashMap<(ThreadId, StackId, bool), fx::StackHandle> = HashMap::new();
    let mut fxframes: HashMap<(FrameId, u32, bool), Arc<FxFrame>> = HashMap::new();
    let cpu = fx::CpuDelta::from_micros(defs.interval_us());
    let bar = progress(defs.sample_count(), "exporting");
    for (n, s) in replay.samples().enumerate() {
        let s = s?;
        if n & 0xffff == 0 {
            bar.set_position(n as u64);
        }
        let thread = defs.thread(s.thread);
        if filter.tid.is_some_and(|tid| tid != thread.tid)
            || from.is_some_and(|f| s.time_us < f)
            || to.is_some_and(|e| s.time_us >= e)
        {
            continue;
        }
        let allowed = if has_python {
            while next_event < events.len() && events[next_event].samples_before <= n as u64 {
                inside.insert(events[next_event].pid, events[next_event].entering);
                next_event += 1;
            }
            inside.get(&thread.pid).copied().unwrap_or(true)
        } else {
            true
        };
        let ctx = Context { thread: Some(s.thread), pid: thread.pid, perf_map_allowed: allowed };
        let th = threads[s.thread.index()];
        let key = (s.thread, s.stack, allowed);
        let stack = match stacks.get(&key) {
            Some(&h) => h,
            None => {
                // Walk up to the nearest ancestor already interned, then intern
                // downwards (root first, as the profile's prefix tree wants).
                let mut path = Vec::new();
                let mut cur = Some(s.stack);
                let mut parent = None;
                while let Some(id) = cur {
                    if let Some(&h) = stacks.get(&(s.thread, id, allowed)) {
                        parent = Some(h);
                        break;
                    }
                    path.push(id);
                    cur = defs.stack(id).parent;
                }
                for &id in path.iter().rev() {
                    let frame = defs.stack(id).frame;
                    let fkey = match defs.frame(frame) {
                        Frame::Absolute { .. } => (frame, thread.pid, allowed),
                        _ => (frame, 0, false),
                    };
                    let fxf = match fxframes.get(&fkey) {
                        Some(f) => f.clone(),
                        None => {
                            let r = sym.resolve(defs, frame, &ctx);
                            let funcs: Vec<u32> = r.frames.iter().rev().map(|f| f.func).collect();
                            let f = match frame_kind
                                .get(&frame)
                                .and_then(|&(mi, rva)| Some((libs.get(&mi)?, rva)))
                            {
                                Some((&lib, rva)) => FxFrame::Lib(lib, rva, funcs[1..].to_vec()),
                                None => FxFrame::Labels(funcs),
                            };
                            let f = Arc::new(f);
                            fxframes.insert(fkey, f.clone());
                            f
                        }
                    };
                    let leaf = id == s.stack;
                    let info = |frame| fx::FrameInfo {
                        frame,
                        category_pair: fx::CategoryHandle::OTHER.into(),
                        flags: fx::FrameFlags::empty(),
                    };
                    let labels = match &*fxf {
                        FxFrame::Lib(lib, rva, inl) => {
                            let a = if leaf {
                                fx::Frame::RelativeAddressFromInstructionPointer(*lib, *rva)
                            } else {
                                fx::Frame::RelativeAddressFromAdjustedReturnAddress(*lib, *rva)
                            };
                            let fh = profile.intern_frame(th, info(a));
                            parent = Some(profile.intern_stack(th, parent, fh));
                            inl.as_slice()
                        }
                        FxFrame::Labels(l) => l.as_slice(),
                    };
                    for &func in labels {
                        let sh = profile.intern_string(&sym.function(func).name);
                        let fh = profile.intern_frame(th, info(fx::Frame::Label(sh)));
                        parent = Some(profile.intern_stack(th, parent, fh));
                    }
                    stacks.insert((s.thread, id, allowed), parent.expect("a stack node has a frame"));
                }
                parent.expect("a stack has a frame")
            }
        };
        let t = fx::Timestamp::from_nanos_since_reference(
            s.time_us.saturating_sub(start_us).saturating_mul(1000),
        );
        profile.add_sample(th, t, Some(stack), cpu, 1);
    }
    bar.finish_and_clear();
    profile.set_symbolicated(true);
    serde_json::to_writer(&mut *out, &profile)
        .map_err(|e| CliError::other(format!("writing the profile: {e}")))?;
    Ok(())
}
