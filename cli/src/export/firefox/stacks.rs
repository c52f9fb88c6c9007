//! The Firefox export's frames and stacks: each spool stack interned once per
//! (thread context, stack) in the profile's prefix tree, each frame with its
//! category, inlined functions behind placeholder labels (filled in by
//! [`super::profile`] once the document is serialized).
//!
//! Frames are in one of three categories: user code, std/libc (the Rust
//! standard library crates, the C and C++ runtime libraries, the vDSO), and
//! unknown (no symbols). The leaf of an off-CPU interval's stack (its
//! `[blocked: futex]` or `[waiting for CPU]` label) is in a fourth, Off-CPU,
//! with the subcategories Blocked and Waiting for CPU: the category a
//! sample's stack shows is its leaf's, so off-CPU time stands apart from CPU
//! time in the Firefox Profiler's graphs and call tree.

use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

use fxprof_processed_profile as fx;
use spulse::{Definitions, FrameId, StackId};

use crate::select::Context;
use crate::symbolize::Symbolizer;

/// What a resolved frame becomes in the Firefox profile.
enum FxFrame {
    /// Library-relative address with the containing function's category, the
    /// inlined functions (outermost first) as placeholder labels, and how
    /// many of the innermost of those are the allocator's.
    Lib(fx::LibraryHandle, u32, fx::CategoryHandle, Vec<(fx::StringHandle, fx::CategoryHandle)>, usize),
    /// Only labels (outermost first).
    Labels(Vec<(fx::StringHandle, fx::CategoryHandle)>),
}

/// An inlined frame behind a placeholder label.
pub(super) struct InlineFrame {
    pub(super) module: usize,
    pub(super) rva: u32,
    pub(super) depth: u32,
    pub(super) func: u32,
    pub(super) file: Option<Rc<str>>,
    pub(super) line: u32,
}

/// The prefix of placeholder labels (never a function name: it starts with a
/// control character).
pub(super) const PLACEHOLDER: &str = "\u{1}spulse-inline-";

/// Library file names of the C and C++ runtimes.
const RUNTIME_LIBS: &[&str] = &[
    "libc.so",
    "libc-",
    "ld-linux",
    "ld64.so",
    "libm.so",
    "libpthread",
    "libdl",
    "libstdc++",
    "libgcc_s",
    "libc++",
    "[vdso]",
    "linux-vdso",
];

/// Whether a function belongs to the Rust standard library or the C/C++ runtime.
fn is_std(name: &str, module: &str) -> bool {
    let n = name.trim_start_matches(['<', '&', '*']);
    ["std::", "core::", "alloc::", "panic_unwind::", "compiler_builtins::", "__rust"]
        .iter()
        .any(|p| n.starts_with(p))
        || RUNTIME_LIBS.iter().any(|l| module.starts_with(l))
}

/// The name of the off-CPU category (its subcategories: [`BLOCKED`] and
/// [`WAITING_FOR_CPU`]).
pub const OFF_CPU_CATEGORY: &str = "Off-CPU";
/// The off-CPU subcategory of blocked intervals.
pub const BLOCKED: &str = "Blocked";
/// The off-CPU subcategory of preempted intervals.
pub const WAITING_FOR_CPU: &str = "Waiting for CPU";

/// The categories frames are put in.
struct Categories {
    user: fx::CategoryHandle,
    std: fx::CategoryHandle,
    unknown: fx::CategoryHandle,
    blocked: fx::CategoryPairHandle,
    waiting: fx::CategoryPairHandle,
}

impl Categories {
    fn new(profile: &mut fx::Profile) -> Categories {
        let user = profile.add_category("User code", fx::CategoryColor::Yellow);
        let std = profile.add_category("Std/libc", fx::CategoryColor::Orange);
        let unknown = profile.add_category("Unknown", fx::CategoryColor::Gray);
        let off = profile.add_category(OFF_CPU_CATEGORY, fx::CategoryColor::Blue);
        let blocked = profile.add_subcategory(off, BLOCKED);
        let waiting = profile.add_subcategory(off, WAITING_FOR_CPU);
        Categories { user, std, unknown, blocked, waiting }
    }

    fn of(&self, sym: &Symbolizer, func: u32, named: bool) -> fx::CategoryHandle {
        let f = sym.function(func);
        if !named {
            self.unknown
        } else if is_std(&f.name, &f.module) {
            self.std
        } else {
            self.user
        }
    }
}

/// What a sample is: its stack's leaf frame gets the category of its
/// function (a CPU sample) or the off-CPU category.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Leaf {
    /// A CPU sample.
    Cpu,
    /// An off-CPU interval, blocked.
    Blocked,
    /// An off-CPU interval, preempted.
    WaitingForCpu,
    /// A heap event: the leaf's inlined allocator functions (`alloc::alloc`
    /// inlined into the code that allocated) are left out.
    Allocation,
}

/// The frames and stacks interned so far, and what interning needs.
pub(super) struct Stacks {
    cats: Categories,
    /// Each module frame with a symbol table entry: (module, rva).
    frame_kind: HashMap<FrameId, (usize, u32)>,
    /// The library of each module with a symbol table.
    libs: HashMap<usize, fx::LibraryHandle>,
    /// The inlined frames behind placeholder labels, by the label's number.
    pub(super) inline_frames: Vec<InlineFrame>,
    placeholders: HashMap<(usize, u32, usize), (fx::StringHandle, fx::CategoryHandle)>,
    stacks: HashMap<(u32, StackId, Leaf), fx::StackHandle>,
    fxframes: HashMap<(FrameId, u32, bool), Arc<FxFrame>>,
}

impl Stacks {
    /// Add the categories to `profile`; `frame_kind` and `libs` as
    /// [`super::profile`] found them.
    pub(super) fn new(
        profile: &mut fx::Profile,
        frame_kind: HashMap<FrameId, (usize, u32)>,
        libs: HashMap<usize, fx::LibraryHandle>,
    ) -> Stacks {
        Stacks {
            cats: Categories::new(profile),
            frame_kind,
            libs,
            inline_frames: Vec::new(),
            placeholders: HashMap::new(),
            stacks: HashMap::new(),
            fxframes: HashMap::new(),
        }
    }

    /// The profile's stack of `stack` in thread `th` (context `ci`, `ctx`):
    /// a CPU sample's stack, or an off-CPU interval's (its leaf node in the
    /// off-CPU category, the rest as a CPU sample's parent frames).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn intern(
        &mut self,
        profile: &mut fx::Profile,
        defs: &Definitions,
        sym: &mut Symbolizer,
        (ci, ctx): (u32, &Context),
        th: fx::ThreadHandle,
        stack: StackId,
        leaf: Leaf,
    ) -> fx::StackHandle {
        if let Some(&h) = self.stacks.get(&(ci, stack, leaf)) {
            return h;
        }
        let off = match leaf {
            Leaf::Cpu | Leaf::Allocation => None,
            Leaf::Blocked => Some(self.cats.blocked),
            Leaf::WaitingForCpu => Some(self.cats.waiting),
        };
        // Walk up to the nearest ancestor already interned, then intern
        // downwards (root first, as the profile's prefix tree wants). An
        // off-CPU or allocation leaf is interned on its own, under its
        // parent's CPU node.
        let mut path = Vec::new();
        let mut cur = Some(stack);
        let mut parent = None;
        if leaf != Leaf::Cpu {
            path.push(stack);
            cur = defs.stack(stack).parent;
        }
        while let Some(id) = cur {
            if let Some(&h) = self.stacks.get(&(ci, id, Leaf::Cpu)) {
                parent = Some(h);
                break;
            }
            path.push(id);
            cur = defs.stack(id).parent;
        }
        for &id in path.iter().rev() {
            let frame = defs.stack(id).frame;
            let fxf = self.frame(profile, defs, sym, ctx, frame);
            let is_leaf = id == stack;
            let info = |frame, category: fx::CategoryPairHandle| fx::FrameInfo {
                frame,
                category_pair: match off {
                    Some(off) if is_leaf => off,
                    _ => category,
                },
                flags: fx::FrameFlags::empty(),
            };
            let labels = match &*fxf {
                FxFrame::Lib(lib, rva, cat, inl, allocator) => {
                    let a = if is_leaf && leaf == Leaf::Cpu {
                        fx::Frame::RelativeAddressFromInstructionPointer(*lib, *rva)
                    } else {
                        fx::Frame::RelativeAddressFromAdjustedReturnAddress(*lib, *rva)
                    };
                    let fh = profile.intern_frame(th, info(a, (*cat).into()));
                    parent = Some(profile.intern_stack(th, parent, fh));
                    if is_leaf && leaf == Leaf::Allocation {
                        &inl[..inl.len() - allocator]
                    } else {
                        inl.as_slice()
                    }
                }
                FxFrame::Labels(l) => l.as_slice(),
            };
            for &(sh, cat) in labels {
                let fh = profile.intern_frame(th, info(fx::Frame::Label(sh), cat.into()));
                parent = Some(profile.intern_stack(th, parent, fh));
            }
            let kind = if is_leaf { leaf } else { Leaf::Cpu };
            self.stacks.insert((ci, id, kind), parent.expect("a stack node has a frame"));
        }
        parent.expect("a stack has a frame")
    }

    /// What `frame` becomes in the profile (resolved once per frame, and per
    /// process for absolute addresses).
    fn frame(
        &mut self,
        profile: &mut fx::Profile,
        defs: &Definitions,
        sym: &mut Symbolizer,
        ctx: &Context,
        frame: FrameId,
    ) -> Arc<FxFrame> {
        let fkey = match defs.frame(frame) {
            spulse::Frame::Absolute { .. } => (frame, ctx.pid, ctx.perf_map_allowed),
            _ => (frame, 0, false),
        };
        if let Some(f) = self.fxframes.get(&fkey) {
            return f.clone();
        }
        let r = sym.resolve(defs, frame, ctx);
        let f = match self.frame_kind.get(&frame).and_then(|&(mi, rva)| Some((mi, self.libs.get(&mi)?, rva)))
        {
            Some((mi, &lib, rva)) => {
                // Inlined functions, outermost first, each behind a
                // placeholder filled in by `profile` (one per address and
                // depth).
                let mut inl = Vec::new();
                for (depth, f) in r.frames.iter().rev().enumerate().skip(1) {
                    if let Some(&h) = self.placeholders.get(&(mi, rva, depth)) {
                        inl.push(h);
                        continue;
                    }
                    let label = format!("{PLACEHOLDER}{}", self.inline_frames.len());
                    self.inline_frames.push(InlineFrame {
                        module: mi,
                        rva,
                        depth: depth as u32,
                        func: f.func,
                        file: f.file.clone(),
                        line: f.line,
                    });
                    let h = (profile.intern_string(&label), self.cats.of(sym, f.func, true));
                    self.placeholders.insert((mi, rva, depth), h);
                    inl.push(h);
                }
                // The innermost inlined functions that are the allocator's
                // (never the containing function).
                let allocator = r.frames[..r.frames.len() - 1]
                    .iter()
                    .take_while(|f| crate::symbolize::is_allocator_frame(&sym.function(f.func).name))
                    .count();
                FxFrame::Lib(lib, rva, self.cats.of(sym, r.outer().func, true), inl, allocator)
            }
            None => FxFrame::Labels(
                r.frames
                    .iter()
                    .rev()
                    .map(|f| {
                        let name = profile.intern_string(&sym.function(f.func).name);
                        (name, self.cats.of(sym, f.func, r.named))
                    })
                    .collect(),
            ),
        };
        let f = Arc::new(f);
        self.fxframes.insert(fkey, f.clone());
        f
    }
}
