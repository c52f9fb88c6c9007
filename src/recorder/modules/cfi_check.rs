//! What the signal handler's unwinder may be handed: each module's
//! `.eh_frame_hdr` search table is rebuilt at load time (in the writer thread,
//! never in the handler) to list only the FDEs whose unwinding provably cannot
//! overflow an integer, so that the handler never panics even when framehop and
//! gimli are compiled with overflow checks (a dependent crate's debug build).
//!
//! # The argument (framehop 0.16 on x86_64, gimli 0.33, `.eh_frame_hdr` lookups)
//! Arithmetic framehop does in the handler, and why it cannot overflow:
//! * Module lookup: `address - base_avma` only after `address >= base_avma`;
//!   `ra - 1` on a non-zero return address; `base_svma + relative` with
//!   `base_svma == 0` (how `modules.rs` builds every module).
//! * Search-table lookup (gimli `EhHdrTable::lookup`): `(len / 2) * row_size`
//!   with `len` the table's FDE count, which this module rewrites to the number
//!   of entries actually present; `pointer_to_offset` computes
//!   `fde_pointer - eh_frame_ptr` unchecked, so every kept entry is checked here
//!   to point at or after `.eh_frame`.
//! * CFI parsing and row evaluation (gimli): wrapping or checked arithmetic
//!   throughout (`Wrapping` factors, `wrapping_add_sized` pointers), a pure
//!   function of the section bytes; an FDE that gimli cannot parse here is
//!   dropped, so the handler never parses one.
//! * Rule translation (`translate_into_unwind_rule`) adds the CFA offset and the
//!   frame pointer's save offset unchecked: kept rows must have that sum in range.
//! * Executing a cached rule: every step is `checked_*` except the read of the
//!   return address at `new_sp - 8`, where `new_sp` is `sp + 8 * n`, `bp + 16`
//!   or `sp + 8 * (n + 1)` from checked additions; `sp` starts as the interrupted
//!   stack pointer (inside the thread's proven stack, far above 8) and every
//!   later `sp` is a previous `new_sp` whose `new_sp - 8` was read successfully
//!   from that stack. So `new_sp >= 8`.
//! * framehop's uncached path (`unwind_frame` in `x86_64/dwarf.rs`) computes
//!   `cfa - 8` unchecked, and evaluates DWARF expressions (which may loop). It is
//!   taken exactly for rows framehop cannot translate into a cached rule, so
//!   every FDE with such a row is dropped from the table: the handler never
//!   takes that path.
//!
//! A lookup inside a dropped FDE finds the previous FDE, which does not cover
//! the address, or none: framehop then uses its checked rules for uncovered code
//! (return address at `sp` for the first frame, frame pointers after it). Such
//! FDEs are rare (PLT stubs, signal trampolines, hand-written assembly); their
//! frames unwind by frame pointer.
//!
//! Tables read in place (the main executable's, which `modules.rs` does not
//! copy) are not rebuilt when the check drops only a few FDEs of a table whose
//! entries ascend strictly: the original table stays, and the code in which a
//! lookup would return a dropped entry ([`Filtered::dropped_ranges`]: gimli's
//! binary search returns the entry with the greatest start at or below the
//! address, or the first entry for an address below them all) is left out of
//! the unwinder's modules. An address there belongs to no module, so framehop
//! unwinds it by frame pointer (checked arithmetic) without a lookup; an
//! address anywhere else only ever finds a kept entry. The stated FDE count is
//! then the original one, and every entry it counts was read by the check, so
//! `(len / 2) * row_size` stays inside the table.
//!
//! Most FDEs are proven safe by a quick reading of their instructions that
//! follows only the rules above ([`Quick`]); gimli evaluates the rows of the
//! others, and of any the quick reading is unsure of.
//!
//! The rules mirrored here are framehop's x86_64 ones; on other architectures
//! `modules.rs` hands the tables over unfiltered and this argument does not apply.

use std::num::Wrapping;

use gimli::{
    BaseAddresses, CfaRule, CommonInformationEntry, EhFrame, EhFrameHdr, EhFrameOffset, LittleEndian,
    Register, RegisterRule, UnwindContext, UnwindSection, UnwindTableRow, X86_64,
};

/// What [`filter_eh_frame_hdr`] kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Filtered {
    /// The rebuilt `.eh_frame_hdr`.
    pub hdr: Vec<u8>,
    /// FDEs kept in the search table.
    pub kept: usize,
    /// FDEs dropped from it.
    pub dropped: usize,
    /// Stated start addresses of the dropped FDEs.
    pub dropped_starts: Vec<u64>,
    /// Positions in the original search table of the dropped FDEs, ascending:
    /// the verdict that [`super::cfi_cache`] keeps.
    pub dropped_entries: Vec<u32>,
    /// When the original table's entries ascend strictly by start address
    /// (all direct pointers): the stated-address ranges in which a lookup in
    /// the original table finds a dropped entry, ascending and disjoint. A
    /// lookup (gimli's binary search) returns the entry with the greatest
    /// start at or below the address, or the first entry below all of them,
    /// so a dropped entry's range runs from its start (from 0 for the first
    /// entry) to the next entry's start (to the end of the address space for
    /// the last). Code outside these ranges may be unwound with the original,
    /// unmodified table.
    pub dropped_ranges: Option<Vec<std::ops::Range<u64>>>,
}

/// Size of a fixed-size `DW_EH_PE_*` value format, `None` for LEB128 (and omit).
fn fixed_size(enc: u8) -> Option<usize> {
    match enc & 0x0f {
        0x00 => Some(8),        // absptr (64-bit)
        0x02 | 0x0a => Some(2), // udata2, sdata2
        0x03 | 0x0b => Some(4), // udata4, sdata4
        0x04 | 0x0c => Some(8), // udata8, sdata8
        _ => None,
    }
}

/// The FDE count an `.eh_frame_hdr` states, when its encodings are fixed-size.
pub(crate) fn fde_count(hdr: &[u8]) -> Option<u64> {
    let (&version, rest) = hdr.split_first()?;
    let (ptr_enc, count_enc) = (*rest.first()?, *rest.get(1)?);
    if version != 1 || count_enc == 0xff {
        return None;
    }
    let at = 4usize.checked_add(fixed_size(ptr_enc)?)?;
    let size = fixed_size(count_enc)?;
    let mut raw = [0u8; 8];
    raw[..size].copy_from_slice(hdr.get(at..at.checked_add(size)?)?);
    Some(u64::from_le_bytes(raw))
}

/// Entries checked between two calls of `filter_eh_frame_hdr`'s `between`.
const ENTRIES_PER_STEP: usize = 1024;

/// Rebuild `hdr` (an `.eh_frame_hdr` at stated address `hdr_svma`) so that its
/// search table lists only FDEs of `eh_frame` (at `eh_frame_svma`) that unwind
/// without the possibility of an integer overflow (see the module doc). `None`
/// when the header cannot be rebuilt (no table, a variable-size encoding, a
/// table gimli cannot read): the caller then gives the module no unwind tables.
///
/// `known_unsound`, when given, is an earlier verdict on these same tables (the
/// positions of the dropped entries, from [`super::cfi_cache`]): the FDEs are
/// then not parsed again, and only the cheap pointer check runs.
///
/// `between` is called after every [`ENTRIES_PER_STEP`] entries, so that a
/// caller can do other work during a long check; when it returns false the
/// check stops and the result is `None`.
pub(crate) fn filter_eh_frame_hdr(
    hdr: &[u8],
    hdr_svma: u64,
    eh_frame: &[u8],
    eh_frame_svma: u64,
    text_svma: u64,
    known_unsound: Option<&[u32]>,
    between: &mut dyn FnMut() -> bool,
) -> Option<Filtered> {
    let (&version, rest) = hdr.split_first()?;
    let (ptr_enc, count_enc, table_enc) = (*rest.first()?, *rest.get(1)?, *rest.get(2)?);
    if version != 1 || count_enc == 0xff || table_enc == 0xff {
        return None;
    }
    let count_at = 4usize.checked_add(fixed_size(ptr_enc)?)?;
    let count_size = fixed_size(count_enc)?;
    let table_at = count_at.checked_add(count_size)?;
    let entry_size = fixed_size(table_enc)?.checked_mul(2)?;

    let bases =
        BaseAddresses::default().set_eh_frame_hdr(hdr_svma).set_eh_frame(eh_frame_svma).set_text(text_svma);
    let parsed = EhFrameHdr::new(hdr, LittleEndian).parse(&bases, 8).ok()?;
    let eh_frame_ptr = parsed.eh_frame_ptr().direct().ok()?;
    let table = parsed.table()?;
    let mut section = EhFrame::new(eh_frame, LittleEndian);
    section.set_address_size(8);
    let mut ctx = UnwindContext::new();
    let mut cies = Cies::new();

    let mut out = hdr.get(..table_at)?.to_vec();
    let mut iter = table.iter(&bases);
    let (mut kept, mut dropped, mut i) = (0usize, 0usize, 0usize);
    let mut dropped_starts = Vec::new();
    let mut dropped_entries = Vec::new();
    let mut ranges = Some(Vec::new());
    let mut prev_start: Option<u64> = None;
    // The start of the dropped range still open (the entry before was dropped).
    let mut open: Option<u64> = None;
    while let Some((start, fde_ptr)) = iter.next().ok()? {
        match start.direct().ok().filter(|&s| prev_start.is_none_or(|p| p < s)) {
            Some(s) => {
                if let (Some(from), Some(r)) = (open.take(), ranges.as_mut()) {
                    r.push(from..s);
                }
                prev_start = Some(s);
            }
            None => ranges = None,
        }
        let entry_at = table_at.checked_add(i.checked_mul(entry_size)?)?;
        let entry = hdr.get(entry_at..entry_at.checked_add(entry_size)?)?;
        let index = u32::try_from(i).ok()?;
        i += 1;
        if i % ENTRIES_PER_STEP == 0 && !between() {
            return None;
        }
        let safe = fde_ptr
            .direct()
            .ok()
            .and_then(|p| p.checked_sub(eh_frame_ptr))
            .and_then(|off| usize::try_from(off).ok())
            .is_some_and(|off| match known_unsound {
                Some(bad) => bad.binary_search(&index).is_err(),
                None => fde_is_safe(&section, &bases, &mut ctx, &mut cies, off),
            });
        if safe {
            out.extend_from_slice(entry);
            kept += 1;
        } else {
            dropped += 1;
            dropped_starts.extend(start.direct().ok());
            dropped_entries.push(index);
            if ranges.is_some() {
                open = Some(if index == 0 { 0 } else { prev_start.unwrap_or(0) });
            }
        }
    }
    if let (Some(from), Some(r)) = (open, ranges.as_mut()) {
        r.push(from..u64::MAX);
    }
    let count = (kept as u64).to_le_bytes();
    if count[count_size..].iter().any(|&b| b != 0) {
        return None;
    }
    out[count_at..table_at].copy_from_slice(&count[..count_size]);
    Some(Filtered { hdr: out, kept, dropped, dropped_starts, dropped_entries, dropped_ranges: ranges })
}

/// The CIEs met so far in one table, each with what [`Quick`] read of its
/// initial instructions (`None`: not readable there). A table has a handful
/// (libc's 3,700 FDEs share three): each is parsed once rather than once per
/// FDE.
type Cies<'a> = Vec<(usize, CommonInformationEntry<gimli::EndianSlice<'a, LittleEndian>>, Option<Quick>)>;

/// Most CIEs [`Cies`] keeps (a table with more parses the others per FDE).
const MAX_CIES: usize = 16;

/// Whether the FDE at `offset` parses and every row of it translates into one of
/// framehop's cached rules without overflow.
///
/// Most FDEs are read by [`Quick`], which follows only the rules the verdict
/// depends on and proves it for the common instructions; the rest (and any
/// FDE `Quick` is unsure of) have every row evaluated by gimli.
fn fde_is_safe<'a>(
    section: &EhFrame<gimli::EndianSlice<'a, LittleEndian>>,
    bases: &BaseAddresses,
    ctx: &mut UnwindContext<usize>,
    cies: &mut Cies<'a>,
    offset: usize,
) -> bool {
    let mut quick_cie = None;
    let get_cie = |section: &EhFrame<gimli::EndianSlice<'a, LittleEndian>>,
                   bases: &BaseAddresses,
                   at: EhFrameOffset<usize>| {
        if let Some((_, cie, quick)) = cies.iter().find(|(o, ..)| *o == at.0) {
            quick_cie = Some(*quick);
            return Ok(cie.clone());
        }
        let cie = section.cie_from_offset(bases, at)?;
        let quick = Quick::of_cie(section, bases, &cie);
        quick_cie = Some(quick);
        if cies.len() < MAX_CIES {
            cies.push((at.0, cie.clone(), quick));
        }
        Ok(cie)
    };
    let Ok(fde) = section.fde_from_offset(bases, EhFrameOffset(offset), get_cie) else {
        return false;
    };
    if let Some(Some(initial)) = quick_cie {
        if initial.fde_is_safe(section, bases, &fde) {
            return true;
        }
    }
    rows_are_cacheable(section, bases, ctx, &fde)
}

/// Whether gimli evaluates every row of `fde` and each is [`row_is_cacheable`].
fn rows_are_cacheable<'a>(
    section: &EhFrame<gimli::EndianSlice<'a, LittleEndian>>,
    bases: &BaseAddresses,
    ctx: &mut UnwindContext<usize>,
    fde: &gimli::FrameDescriptionEntry<gimli::EndianSlice<'a, LittleEndian>>,
) -> bool {
    let Ok(mut rows) = fde.rows(section, bases, ctx) else { return false };
    loop {
        match rows.next_row() {
            Ok(Some(row)) => {
                if !row_is_cacheable(row) {
                    return false;
                }
            }
            Ok(None) => return true,
            Err(_) => return false,
        }
    }
}

/// A register's rule, as the verdict sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Rule {
    /// No rule (gimli's `None`).
    Unset,
    Undefined,
    SameValue,
    /// Saved at the CFA plus this.
    Offset(i64),
    /// Any other rule.
    Other,
}

impl Rule {
    fn of(rule: Option<RegisterRule<usize>>) -> Rule {
        match rule {
            None => Rule::Unset,
            Some(RegisterRule::Undefined) => Rule::Undefined,
            Some(RegisterRule::SameValue) => Rule::SameValue,
            Some(RegisterRule::Offset(o)) => Rule::Offset(o),
            Some(_) => Rule::Other,
        }
    }
}

/// Whether framehop 0.16 turns `row` into a cached x86_64 rule (and the
/// translation's own arithmetic stays in range). Mirrors its
/// `translate_into_unwind_rule`: a row it would evaluate on the uncached path
/// is not cacheable.
fn row_is_cacheable(row: &UnwindTableRow<usize>) -> bool {
    let cfa = match *row.cfa() {
        CfaRule::RegisterAndOffset { register, offset } => Some((register, offset)),
        CfaRule::Expression(_) => None,
    };
    cacheable(Rule::of(row.register(X86_64::RA)), Rule::of(row.register(X86_64::RBP)), cfa)
}

/// [`row_is_cacheable`] for a row whose return address has rule `ra`, frame
/// pointer `bp` and CFA `cfa` (register and offset; `None`: an expression).
fn cacheable(ra: Rule, bp: Rule, cfa: Option<(Register, i64)>) -> bool {
    match ra {
        Rule::Unset | Rule::Undefined => return true, // end of stack
        Rule::Offset(-8) => {}
        _ => return false,
    }
    // The frame pointer's save offset from the CFA, if it is saved.
    let bp = match bp {
        Rule::Unset | Rule::Undefined | Rule::SameValue => None,
        Rule::Offset(o) => Some(o),
        Rule::Other => return false,
    };
    match cfa {
        Some((register, offset)) if register == X86_64::RSP => {
            if u16::try_from(offset / 8).is_err() {
                return false;
            }
            match bp {
                None => true,
                Some(bp) => offset.checked_add(bp).is_some_and(|s| i16::try_from(s / 8).is_ok()),
            }
        }
        Some((register, offset)) if register == X86_64::RBP => offset == 16 && bp == Some(-16),
        _ => false,
    }
}

/// Rule-setting instructions (CIE and FDE together) [`Quick`] reads; past
/// them it is unsure. gimli holds 192 registers' rules a row and fails past
/// them: fewer instructions cannot set more registers.
const QUICK_MAX_RULES: u32 = 64;

/// `DW_CFA_remember_state` nesting [`Quick`] reads; deeper it is unsure.
/// gimli's stack holds 4 rows: the current one, the initial rules' copy (when
/// the CIE sets two registers or more) and so 2 remembered ones.
const QUICK_MAX_DEPTH: usize = 2;

/// The rules the verdict depends on: the CFA's register and offset, the
/// return address's and the frame pointer's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Rules {
    cfa: (Register, i64),
    ra: Rule,
    bp: Rule,
}

/// A quick reading of an FDE's instructions that follows only [`Rules`],
/// instruction by instruction as gimli's `UnwindTable` evaluates them (the
/// same parser, the same wrapping arithmetic), without building rows. It
/// either proves that every row gimli would produce is [`cacheable`] and
/// that gimli's evaluation cannot fail, or is unsure: an instruction outside
/// the common ones (`DW_CFA_set_loc`, CFA expressions, instructions in a CIE
/// other than the CFA and register rules, ...), more than
/// [`QUICK_MAX_RULES`] rules or [`QUICK_MAX_DEPTH`] remembered states, an
/// address past the end of the address space, or a row not cacheable. Unsure
/// is not a verdict: gimli then evaluates the rows. This reading is the
/// check's fast path (the unwinder's first build in a Rust program: 31.9 M
/// instructions before, 17.3 M with it, libc's 3,700 FDEs most of them), never
/// a looser rule: `tests::the_quick_reading_agrees_with_gimli` compares the
/// two on every FDE of the machine's libraries.
#[derive(Clone, Copy, Debug)]
struct Quick {
    /// The rules after the CIE's initial instructions (what
    /// `DW_CFA_restore` goes back to).
    initial: Rules,
    /// Rule-setting instructions read in the CIE.
    cie_rules: u32,
}

impl Quick {
    /// Read the CIE's initial instructions; `None` when unsure.
    fn of_cie<'a>(
        section: &EhFrame<gimli::EndianSlice<'a, LittleEndian>>,
        bases: &BaseAddresses,
        cie: &CommonInformationEntry<gimli::EndianSlice<'a, LittleEndian>>,
    ) -> Option<Quick> {
        use gimli::CallFrameInstruction as I;
        let data_align = Wrapping(cie.data_alignment_factor());
        // gimli's default row: CFA register 0 plus 0, no register rules.
        let mut rules = Rules { cfa: (Register(0), 0), ra: Rule::Unset, bp: Rule::Unset };
        let mut count = 0u32;
        let mut insns = cie.instructions(section, bases);
        while let Some(insn) = insns.next().ok()? {
            if !matches!(insn, I::Nop) && !rules.apply(&insn, data_align, &mut count)? {
                return None;
            }
        }
        Some(Quick { initial: rules, cie_rules: count })
    }

    /// Whether every row of `fde` (whose CIE this reading is of) is proven
    /// cacheable; false when unsure.
    fn fde_is_safe<'a>(
        &self,
        section: &EhFrame<gimli::EndianSlice<'a, LittleEndian>>,
        bases: &BaseAddresses,
        fde: &gimli::FrameDescriptionEntry<gimli::EndianSlice<'a, LittleEndian>>,
    ) -> bool {
        self.read_fde(section, bases, fde).is_some()
    }

    /// [`Quick::fde_is_safe`]: `Some` when proven.
    fn read_fde<'a>(
        &self,
        section: &EhFrame<gimli::EndianSlice<'a, LittleEndian>>,
        bases: &BaseAddresses,
        fde: &gimli::FrameDescriptionEntry<gimli::EndianSlice<'a, LittleEndian>>,
    ) -> Option<()> {
        use gimli::CallFrameInstruction as I;
        let cie = fde.cie();
        let (code_align, data_align) = (cie.code_alignment_factor(), Wrapping(cie.data_alignment_factor()));
        if cie.address_size() != 8 {
            return None;
        }
        let row_ok = |r: &Rules| cacheable(r.ra, r.bp, Some(r.cfa)).then_some(());
        let mut rules = self.initial;
        let mut count = self.cie_rules;
        let mut stack = [rules; QUICK_MAX_DEPTH];
        let mut depth = 0usize;
        let mut address = fde.initial_address();
        let mut insns = fde.instructions(section, bases);
        while let Some(insn) = insns.next().ok()? {
            if rules.apply(&insn, data_align, &mut count)? {
                continue;
            }
            match insn {
                I::Nop | I::ArgsSize { .. } => {}
                I::AdvanceLoc { delta } => {
                    // The row ends here; the next one starts at an address
                    // gimli computes with `add_sized` (an error past the end
                    // of the address space).
                    row_ok(&rules)?;
                    address = address.checked_add(u64::from(delta).checked_mul(code_align)?)?;
                }
                I::ValOffset { register, .. }
                | I::ValOffsetSf { register, .. }
                | I::Register { dest_register: register, .. }
                | I::Expression { register, .. }
                | I::ValExpression { register, .. } => rules.set(register, Rule::Other, &mut count)?,
                I::Restore { register } => {
                    let initial = if register == X86_64::RA {
                        self.initial.ra
                    } else if register == X86_64::RBP {
                        self.initial.bp
                    } else {
                        Rule::Unset
                    };
                    rules.set(register, initial, &mut count)?;
                }
                I::RememberState => {
                    *stack.get_mut(depth)? = rules;
                    depth += 1;
                }
                I::RestoreState => {
                    depth = depth.checked_sub(1)?;
                    rules = stack[depth];
                }
                _ => return None,
            }
        }
        row_ok(&rules)
    }
}

impl Rules {
    /// Apply `insn` if it is one of the instructions a CIE's initial ones
    /// may be here (the CFA's and the register rules'): `Some(true)`;
    /// `Some(false)` for any other; `None` when unsure.
    fn apply(
        &mut self,
        insn: &gimli::CallFrameInstruction<usize>,
        data_align: Wrapping<i64>,
        count: &mut u32,
    ) -> Option<bool> {
        use gimli::CallFrameInstruction as I;
        match *insn {
            I::DefCfa { .. }
            | I::DefCfaSf { .. }
            | I::DefCfaRegister { .. }
            | I::DefCfaOffset { .. }
            | I::DefCfaOffsetSf { .. } => {
                self.cfa = cfa_after(self.cfa, insn, data_align)?;
            }
            I::Undefined { register } => self.set(register, Rule::Undefined, count)?,
            I::SameValue { register } => self.set(register, Rule::SameValue, count)?,
            I::Offset { register, factored_offset } => {
                self.set(register, Rule::Offset((Wrapping(factored_offset as i64) * data_align).0), count)?
            }
            I::OffsetExtendedSf { register, factored_offset } => {
                self.set(register, Rule::Offset((Wrapping(factored_offset) * data_align).0), count)?
            }
            _ => return Some(false),
        }
        Some(true)
    }

    /// Set `register`'s rule (only the return address's and the frame
    /// pointer's are followed), counting the instruction against
    /// [`QUICK_MAX_RULES`]; `None` past it.
    fn set(&mut self, register: Register, rule: Rule, count: &mut u32) -> Option<()> {
        *count += 1;
        if *count > QUICK_MAX_RULES {
            return None;
        }
        if register == X86_64::RA {
            self.ra = rule;
        } else if register == X86_64::RBP {
            self.bp = rule;
        }
        Some(())
    }
}

/// The CFA after one of the `DW_CFA_def_cfa*` instructions (not
/// `def_cfa_expression`), as gimli computes it (the CFA here is always a
/// register and offset, so `def_cfa_register` and `def_cfa_offset` cannot
/// fail).
fn cfa_after(
    cfa: (Register, i64),
    insn: &gimli::CallFrameInstruction<usize>,
    data_align: Wrapping<i64>,
) -> Option<(Register, i64)> {
    use gimli::CallFrameInstruction as I;
    Some(match *insn {
        I::DefCfa { register, offset } => (register, offset as i64),
        I::DefCfaSf { register, factored_offset } => (register, (Wrapping(factored_offset) * data_align).0),
        I::DefCfaRegister { register } => (register, cfa.1),
        I::DefCfaOffset { offset } => (cfa.0, offset as i64),
        I::DefCfaOffsetSf { factored_offset } => (cfa.0, (Wrapping(factored_offset) * data_align).0),
        _ => return None,
    })
}

/// Builders of synthetic `.eh_frame` / `.eh_frame_hdr` sections for tests.
#[cfg(test)]
pub(crate) mod synth {
    /// Append a CIE (code align 1, data align -8, RA = r16, augmentation "zR"
    /// with pcrel|sdata4 FDE pointers) and return its offset.
    pub(crate) fn cie(out: &mut Vec<u8>, initial: &[u8]) -> usize {
        let at = out.len();
        let mut body = vec![0, 0, 0, 0, 1, b'z', b'R', 0, 1, 0x78, 16, 1, 0x1b];
        body.extend_from_slice(initial);
        while (body.len() + 4) % 8 != 0 {
            body.push(0); // DW_CFA_nop
        }
        out.extend_from_slice(&(body.len() as u32).to_le_bytes());
        out.extend_from_slice(&body);
        at
    }

    /// Append an FDE for `[pc, pc + len)` (stated addresses, `.eh_frame` at
    /// `eh_svma`) with `insns`; return its offset.
    pub(crate) fn fde(
        out: &mut Vec<u8>,
        eh_svma: u64,
        cie_at: usize,
        pc: u64,
        len: u32,
        insns: &[u8],
    ) -> usize {
        let at = out.len();
        let mut body = Vec::new();
        body.extend_from_slice(&((at + 4 - cie_at) as u32).to_le_bytes());
        let field = eh_svma + at as u64 + 8;
        body.extend_from_slice(&(pc.wrapping_sub(field) as i32).to_le_bytes());
        body.extend_from_slice(&len.to_le_bytes());
        body.push(0); // augmentation data length
        body.extend_from_slice(insns);
        while (body.len() + 4) % 8 != 0 {
            body.push(0);
        }
        out.extend_from_slice(&(body.len() as u32).to_le_bytes());
        out.extend_from_slice(&body);
        at
    }

    /// An `.eh_frame_hdr` (pcrel|sdata4 eh_frame_ptr, udata4 count,
    /// datarel|sdata4 table) for `(pc, fde offset)` entries.
    pub(crate) fn hdr(hdr_svma: u64, eh_svma: u64, entries: &[(u64, usize)]) -> Vec<u8> {
        let mut h = vec![1, 0x1b, 0x03, 0x3b];
        h.extend_from_slice(&((eh_svma.wrapping_sub(hdr_svma + 4)) as i32).to_le_bytes());
        h.extend_from_slice(&(entries.len() as u32).to_le_bytes());
        for &(pc, off) in entries {
            h.extend_from_slice(&(pc.wrapping_sub(hdr_svma) as i32).to_le_bytes());
            h.extend_from_slice(&((eh_svma + off as u64).wrapping_sub(hdr_svma) as i32).to_le_bytes());
        }
        h
    }
}

#[cfg(test)]
mod tests {
    use super::synth::*;
    use super::*;

    #[test]
    fn keeps_cacheable_fdes_and_drops_the_rest() {
        let (hdr_svma, eh_svma, text) = (0x1000u64, 0x2000u64, 0x10000u64);
        let mut eh = Vec::new();
        // CIE: CFA = rsp + 8, RA at CFA - 8.
        let c = cie(&mut eh, &[0x0c, 7, 8, 0x90, 1]);
        // Plain function: push rbp; mov rbp, rsp => CFA = rbp + 16, rbp at CFA - 16.
        let good = fde(&mut eh, eh_svma, c, text, 0x40, &[0x41, 0x0e, 16, 0x86, 2, 0x43, 0x0d, 6]);
        // PLT-like: CFA is an expression (DW_CFA_def_cfa_expression: breg7 +8).
        let expr = fde(&mut eh, eh_svma, c, text + 0x40, 0x10, &[0x0f, 2, 0x77, 8]);
        // CFA = rbp + 0 with rbp saved at CFA - 16: framehop's uncached path.
        let odd = fde(&mut eh, eh_svma, c, text + 0x50, 0x10, &[0x0c, 6, 0, 0x86, 2]);
        // CFA = rsp + 8, rbp saved at CFA + (i64::MAX - 7) (factored 2^60 + 1
        // times -8, wrapping): framehop's `offset + bp_offset` would overflow.
        let huge = fde(
            &mut eh,
            eh_svma,
            c,
            text + 0x60,
            0x10,
            &[0x86, 0x81, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x10],
        );
        // RA saved at CFA - 16: uncached.
        let ra = fde(&mut eh, eh_svma, c, text + 0x70, 0x10, &[0x90, 2]);
        eh.extend_from_slice(&[0, 0, 0, 0]); // terminator
        let entries =
            [(text, good), (text + 0x40, expr), (text + 0x50, odd), (text + 0x60, huge), (text + 0x70, ra)];
        let h = hdr(hdr_svma, eh_svma, &entries);
        let f = filter_eh_frame_hdr(&h, hdr_svma, &eh, eh_svma, text, None, &mut || true)
            .expect("rebuildable header");
        assert_eq!((f.kept, f.dropped), (1, 4));
        assert_eq!(fde_count(&h), Some(5));
        assert_eq!(fde_count(&f.hdr), Some(1));
        // A caller that gives up between steps gets no table (the check of a
        // table this small has no step to give up at).
        assert!(filter_eh_frame_hdr(&h, hdr_svma, &eh, eh_svma, text, None, &mut || false).is_some());
        assert_eq!(f.dropped_starts, [text + 0x40, text + 0x50, text + 0x60, text + 0x70]);
        assert_eq!(f.hdr, hdr(hdr_svma, eh_svma, &entries[..1]));
        assert_eq!(f.dropped_entries, [1, 2, 3, 4]);
        assert_eq!(
            f.dropped_ranges,
            Some(vec![
                text + 0x40..text + 0x50,
                text + 0x50..text + 0x60,
                text + 0x60..text + 0x70,
                text + 0x70..u64::MAX
            ])
        );
        // The same verdict handed back (as the cache does) rebuilds the same
        // table without parsing an FDE; a verdict that says otherwise is what
        // the table becomes, so the cache must only ever hold real verdicts.
        let again =
            filter_eh_frame_hdr(&h, hdr_svma, &eh, eh_svma, text, Some(&f.dropped_entries), &mut || true)
                .unwrap();
        assert_eq!(again, f);
        let other = filter_eh_frame_hdr(&h, hdr_svma, &eh, eh_svma, text, Some(&[0]), &mut || true).unwrap();
        assert_eq!((other.kept, other.dropped, other.dropped_entries), (4, 1, vec![0]));
        // A dropped first entry also takes the addresses below every entry.
        let below_all: Vec<std::ops::Range<u64>> = std::iter::once(0..text + 0x40).collect();
        assert_eq!(other.dropped_ranges, Some(below_all));
        // Entries out of order: no ranges (the table must then be rebuilt).
        let swapped = hdr(hdr_svma, eh_svma, &[entries[1], entries[0]]);
        let f = filter_eh_frame_hdr(&swapped, hdr_svma, &eh, eh_svma, text, None, &mut || true).unwrap();
        assert_eq!((f.kept, f.dropped_ranges), (1, None));

        // An entry pointing before .eh_frame (framehop would subtract unchecked).
        let mut bad = hdr(hdr_svma, eh_svma, &[(text, good)]);
        let moved = (eh_svma + 0x100).wrapping_sub(hdr_svma + 4) as i32;
        bad[4..8].copy_from_slice(&moved.to_le_bytes());
        let f = filter_eh_frame_hdr(&bad, hdr_svma, &eh, eh_svma, text, None, &mut || true).unwrap();
        assert_eq!((f.kept, f.dropped), (0, 1));

        // A LEB128 table encoding cannot be rebuilt in place.
        let mut leb = h.clone();
        leb[3] = 0x31;
        assert!(filter_eh_frame_hdr(&leb, hdr_svma, &eh, eh_svma, text, None, &mut || true).is_none());
    }

    /// The quick reading's verdict and gimli's rows' verdict on the FDE at
    /// `offset`: (`Some(true)` proven / `None` unsure, gimli's).
    fn both(eh: &[u8], eh_svma: u64, text: u64, offset: usize) -> (Option<bool>, bool) {
        let bases = BaseAddresses::default().set_eh_frame(eh_svma).set_text(text);
        let mut section = EhFrame::new(eh, LittleEndian);
        section.set_address_size(8);
        let Ok(fde) = section.fde_from_offset(&bases, EhFrameOffset(offset), EhFrame::cie_from_offset) else {
            return (None, false);
        };
        let quick = Quick::of_cie(&section, &bases, fde.cie())
            .and_then(|q| q.fde_is_safe(&section, &bases, &fde).then_some(true));
        (quick, rows_are_cacheable(&section, &bases, &mut UnwindContext::new(), &fde))
    }

    #[test]
    fn the_quick_reading_proves_the_common_frames_and_nothing_gimli_refuses() {
        let (eh_svma, text) = (0x2000u64, 0x10000u64);
        let mut eh = Vec::new();
        // CIE: CFA = rsp + 8, RA at CFA - 8 (what compilers emit).
        let c = cie(&mut eh, &[0x0c, 7, 8, 0x90, 1]);
        // A CIE with a CFA expression: the quick reading is unsure of it.
        let c_expr = cie(&mut eh, &[0x0f, 2, 0x77, 8, 0x90, 1]);
        // (what, CIE, instructions, quick reading, gimli's rows)
        type Case<'a> = (&'a str, usize, &'a [u8], Option<bool>, bool);
        let cases: &[Case] = &[
            // push rbp; mov rbp, rsp; ...; leave (remember/restore around it).
            (
                "frame pointer prologue",
                c,
                &[0x41, 0x0e, 16, 0x86, 2, 0x43, 0x0d, 6, 0x0a, 0x48, 0x0c, 7, 8, 0x0b],
                Some(true),
                true,
            ),
            ("no instructions", c, &[], Some(true), true),
            (
                "pushes without a frame pointer",
                c,
                &[0x41, 0x0e, 16, 0x41, 0x0e, 24, 0x83, 3, 0x42, 0x0e, 8, 0xc3],
                Some(true),
                true,
            ),
            ("CFA on rbp, frame pointer not saved", c, &[0x41, 0x0c, 6, 16], None, false),
            ("RA saved elsewhere", c, &[0x90, 2], None, false),
            ("CFA expression", c, &[0x0f, 2, 0x77, 8], None, false),
            ("in a CIE with a CFA expression", c_expr, &[0x41, 0x0e, 16], None, false),
            // The unacceptable row is transient: gimli never emits it (no
            // advance before the CFA is set back), so both accept.
            ("transient odd CFA", c, &[0x0c, 6, 0, 0x0c, 7, 8], Some(true), true),
            ("odd CFA at a row", c, &[0x0c, 6, 0, 0x41, 0x0c, 7, 8], None, false),
            ("restore_state with nothing remembered", c, &[0x0b], None, false),
            ("three remembered states", c, &[0x0a, 0x0a, 0x0a, 0x0b, 0x0b, 0x0b], None, true),
            (
                "restore of rbp to the CIE's (unset)",
                c,
                &[0x41, 0x0e, 16, 0x86, 2, 0x41, 0xc6],
                Some(true),
                true,
            ),
            ("rbp kept in a register", c, &[0x41, 0x09, 6, 3], None, false),
            ("another register's expression", c, &[0x41, 0x10, 3, 1, 0x30], Some(true), true),
            ("DW_CFA_set_loc", c, &[0x01, 0, 0, 0, 0], None, false),
            ("an offset too far for framehop", c, &[0x41, 0x0e, 0x80, 0x80, 0x80, 0x04], None, false),
        ];
        for &(what, cie_at, insns, quick, gimli) in cases {
            let mut eh = eh.clone();
            let at = fde(&mut eh, eh_svma, cie_at, text, 0x100, insns);
            eh.extend_from_slice(&[0, 0, 0, 0]);
            assert_eq!(both(&eh, eh_svma, text, at), (quick, gimli), "{what}");
        }
    }

    /// Every FDE of the machine's libraries (and of this test): where the
    /// quick reading proves an FDE safe, gimli's rows agree, and it proves
    /// most of them (else it is no fast path).
    #[test]
    #[cfg(all(target_arch = "x86_64", target_os = "linux", target_env = "gnu"))]
    fn the_quick_reading_agrees_with_gimli() {
        use object::{Object, ObjectSection};
        let mut files: Vec<std::path::PathBuf> =
            vec![std::env::current_exe().unwrap(), "/lib/x86_64-linux-gnu/libc.so.6".into()];
        for dir in ["/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64"] {
            let Ok(rd) = std::fs::read_dir(dir) else { continue };
            let mut libs: Vec<_> = rd
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.contains(".so")))
                .collect();
            libs.sort();
            files.extend(libs);
        }
        // Once each (`/lib` is often `/usr/lib`).
        let mut seen = std::collections::HashSet::new();
        files.retain(|p| seen.insert(std::fs::canonicalize(p).unwrap_or_else(|_| p.clone())));
        // A debug build evaluates rows some 30 times slower.
        let budget: usize = if cfg!(debug_assertions) { 30_000 } else { 400_000 };
        let (mut fdes, mut proven, mut objects) = (0usize, 0usize, 0usize);
        let mut libc_seen = false;
        for path in &files {
            if fdes >= budget {
                break;
            }
            let Ok(data) = std::fs::read(path) else { continue };
            let Ok(obj) = object::File::parse(&*data) else { continue };
            if obj.architecture() != object::Architecture::X86_64 {
                continue;
            }
            let (Some(hdr), Some(ehs)) =
                (obj.section_by_name(".eh_frame_hdr"), obj.section_by_name(".eh_frame"))
            else {
                continue;
            };
            let (Ok(hdr_bytes), Ok(eh_bytes)) = (hdr.data(), ehs.data()) else { continue };
            let text = obj.section_by_name(".text").map_or(0, |t| t.address());
            let bases = BaseAddresses::default()
                .set_eh_frame_hdr(hdr.address())
                .set_eh_frame(ehs.address())
                .set_text(text);
            let Ok(parsed) = EhFrameHdr::new(hdr_bytes, LittleEndian).parse(&bases, 8) else { continue };
            let (Ok(eh_ptr), Some(table)) = (parsed.eh_frame_ptr().direct(), parsed.table()) else {
                continue;
            };
            objects += 1;
            libc_seen |= path.file_name().is_some_and(|n| n == "libc.so.6");
            let mut iter = table.iter(&bases);
            while let Ok(Some((_, ptr))) = iter.next() {
                let Some(off) = ptr.direct().ok().and_then(|p| p.checked_sub(eh_ptr)) else { continue };
                let (quick, gimli) = both(eh_bytes, ehs.address(), text, off as usize);
                fdes += 1;
                if quick == Some(true) {
                    proven += 1;
                    assert!(
                        gimli,
                        "{}: the quick reading proves the FDE at {off:#x} that gimli refuses",
                        path.display()
                    );
                }
            }
        }
        eprintln!("{objects} objects, {fdes} FDEs, {proven} proven by the quick reading");
        assert!(libc_seen, "libc.so.6 not found");
        assert!(fdes > 1_000, "only {fdes} FDEs found");
        assert!(proven * 10 >= fdes * 8, "the quick reading proves only {proven} of {fdes} FDEs");
    }
}
