//! One coded column: its encoder, and [`Column`], the parsed and checked
//! column of a decoded block with its branch-free decoder.

use super::bits::with_width;
use super::*;

/// Encode `vals` as a coded column onto `out`. `signed` orders the
/// dictionary as `i64` (time deltas, which may be negative) rather than
/// `u64`, so that its gaps stay small.
pub(super) fn encode_column(vals: &[u64], signed: bool, out: &mut Vec<u8>) {
    let key = |v: u64| if signed { v ^ (1 << 63) } else { v };
    let mut dict: Vec<u64> = vals.iter().map(|&v| key(v)).collect();
    dict.sort_unstable();
    dict.dedup();
    let idx: Vec<u32> =
        vals.iter().map(|&v| dict.binary_search(&key(v)).expect("in the dictionary") as u32).collect();
    for d in &mut dict {
        *d = key(*d);
    }
    let (c, d) = (vals.len() as u64, dict.len() as u64);
    let wi = bit_width(d.saturating_sub(1));
    let gw = dict.windows(2).map(|w| bit_width(w[1].wrapping_sub(w[0]))).max().unwrap_or(0);
    let mut counts = vec![0u64; dict.len()];
    for &i in &idx {
        counts[i as usize] += 1;
    }
    // Dictionary indices, most frequent first.
    let mut order: Vec<u32> = (0..dict.len() as u32).collect();
    order.sort_by(|&a, &b| counts[b as usize].cmp(&counts[a as usize]).then(a.cmp(&b)));
    let mut covered = vec![0u64; order.len() + 1];
    for (r, &o) in order.iter().enumerate() {
        covered[r + 1] = covered[r] + counts[o as usize];
    }
    // The code width that makes codes, escapes and the frequent table
    // smallest (0: every value an escape, i.e. plain dictionary indices).
    let cost = |k: u32| -> (u64, u64) {
        if k == 0 {
            return (c * wi as u64, 0);
        }
        let f = d.min((1 << k) - 1);
        (c * k as u64 + (c - covered[f as usize]) * wi as u64 + f * wi as u64, f)
    };
    let k = (0..=MAX_CODE_WIDTH).min_by_key(|&k| cost(k).0).expect("some width");
    let f = cost(k).1;
    let esc = (1u64 << k) - 1;
    let m = c - covered[f as usize];

    out.extend_from_slice(&dict.first().copied().unwrap_or(0).to_le_bytes());
    out.extend_from_slice(&(d as u32).to_le_bytes());
    out.push(gw as u8);
    out.push(k as u8);
    out.extend_from_slice(&(f as u16).to_le_bytes());
    out.extend_from_slice(&(m as u32).to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    let mut w = BitWriter::new(out);
    for g in dict.windows(2) {
        w.put(g[1].wrapping_sub(g[0]), gw);
    }
    w.finish();
    let mut w = BitWriter::new(out);
    for &o in &order[..f as usize] {
        w.put(o as u64, wi);
    }
    w.finish();
    let mut rank = vec![esc; dict.len()];
    for (r, &o) in order[..f as usize].iter().enumerate() {
        rank[o as usize] = r as u64;
    }
    let mut w = BitWriter::new(out);
    for &i in &idx {
        w.put(rank[i as usize], k);
    }
    w.finish();
    let mut w = BitWriter::new(out);
    for &i in idx.iter().filter(|&&i| rank[i as usize] == esc) {
        w.put(i as u64, wi);
    }
    w.finish();
}

/// A parsed, checked coded column of a decoded block.
#[derive(Debug, Clone)]
pub(crate) struct Column {
    /// Values the column holds.
    pub(super) count: usize,
    /// Code width (0: every value an escape).
    pub(super) code_width: u32,
    /// Width of a dictionary index.
    pub(super) index_width: u32,
    /// Start of the codes and escapes in the decoded block.
    pub(super) codes_at: usize,
    pub(super) escapes_at: usize,
    /// Escapes the codes announce.
    pub(super) escapes: usize,
    /// Entries of the frequent table.
    pub(super) frequent: usize,
    /// The value of each code below the frequent count (others unused).
    pub(super) table: Vec<u64>,
    /// The dictionary.
    pub(super) dict: Vec<u64>,
}

/// Bytes of a section of `n` fields of `width` bits.
pub(super) fn section_len(n: u64, width: u32) -> u64 {
    (n * width as u64).div_ceil(8)
}

impl Column {
    /// Parse the coded column of `count` values at `*pos` of `raw` (the
    /// decoded block of `len` bytes, padded), moving `*pos` past it. Errors
    /// name the offset in the decoded block.
    pub(crate) fn parse(
        raw: &[u8],
        len: usize,
        pos: &mut usize,
        count: usize,
        what: &str,
    ) -> Result<Column, String> {
        let at = *pos;
        if len - at.min(len) < COLUMN_HEADER_LEN {
            return Err(format!("the {what} column's header at decoded byte {at} runs past the block's end"));
        }
        let h = &raw[at..at + COLUMN_HEADER_LEN];
        let base = le64(&h[0..8]);
        let d = le32(&h[8..12]) as u64;
        let (gw, k) = (h[12] as u32, h[13] as u32);
        let f = u16::from_le_bytes([h[14], h[15]]) as u64;
        let m = le32(&h[16..20]) as u64;
        let bad = |why: String| Err(format!("the {what} column at decoded byte {at}: {why}"));
        let c = count as u64;
        if d > c || (d == 0) != (c == 0) {
            return bad(format!("{d} distinct values for {c} values"));
        }
        if le32(&h[20..24]) != 0 {
            return bad("the reserved field is not zero".into());
        }
        if gw > 64 || k > MAX_CODE_WIDTH {
            return bad(format!(
                "gap width {gw} or code width {k} out of range (at most 64 and {MAX_CODE_WIDTH})"
            ));
        }
        let limit = if k == 0 { 0 } else { d.min((1 << k) - 1) };
        if f > limit {
            return bad(format!("{f} frequent values with code width {k} and {d} distinct values"));
        }
        // The table of `2^k` code values below is what a block kept coded
        // holds per column: a code width no wider than its frequent table
        // needs keeps it within twice the table (FORMAT.md, section 10).
        if k > 0 && f < 1 << (k - 1) {
            return bad(format!(
                "code width {k} for {f} frequent values (at most {} bits are needed)",
                bit_width(f)
            ));
        }
        if m > c || (k == 0 && m != c) {
            return bad(format!("{m} escapes for {c} values with code width {k}"));
        }
        let wi = bit_width(d.saturating_sub(1));
        let gaps_at = (at + COLUMN_HEADER_LEN) as u64;
        let freq_at = gaps_at + section_len(d.saturating_sub(1), gw);
        let codes_at = freq_at + section_len(f, wi);
        let escapes_at = codes_at + section_len(c, k);
        let end = escapes_at + section_len(m, wi);
        if end > len as u64 {
            return bad(format!("its sections end at decoded byte {end}, past the block's {len} bytes"));
        }
        let mut dict = Vec::with_capacity(d as usize);
        let mut v = base;
        for j in 0..d as usize {
            if j > 0 {
                v = v.wrapping_add(field(raw, gaps_at as usize, j - 1, gw));
            }
            dict.push(v);
        }
        // Unused codes (from `f` on) map to 0; `decode` refuses them.
        let mut table = vec![0u64; 1 << k];
        for (r, t) in table.iter_mut().enumerate().take(f as usize) {
            let i = narrow_field(raw, freq_at as usize, r, wi);
            if i >= d {
                return bad(format!("frequent value {r} is dictionary entry {i} of {d}"));
            }
            *t = dict[i as usize];
        }
        *pos = end as usize;
        Ok(Column {
            count,
            code_width: k,
            index_width: wi,
            codes_at: codes_at as usize,
            escapes_at: escapes_at as usize,
            escapes: m as usize,
            frequent: f as usize,
            table,
            dict,
        })
    }

    /// The largest dictionary value (every value of the column is one of
    /// them); `None` for an empty column.
    pub(crate) fn max_value(&self) -> Option<u64> {
        self.dict.iter().copied().max()
    }

    /// Check the escape section: each escape a dictionary index. Indices of
    /// 1 to 8 bits are compared with the dictionary's size straight from the
    /// packed bits ([`fields_below`]); wider ones are unpacked into `codes` a
    /// chunk at a time and their largest taken by a reduction the compiler
    /// vectorizes.
    pub(crate) fn check_escapes(&self, raw: &[u8], codes: &mut Vec<u16>) -> Result<(), String> {
        let d = self.dict.len();
        if (1..=8).contains(&self.index_width) && self.escapes > 0 {
            // Narrow indices (a column of a few threads, every value an
            // escape): compared with `d` straight from the packed bits.
            if !fields_below(raw, self.escapes_at, self.index_width, self.escapes, d as u64) {
                return Err(format!("an escape is not one of the {d} dictionary entries"));
            }
            return Ok(());
        }
        let mut top = 0u16;
        let mut start = 0;
        while start < self.escapes {
            let n = CHUNK.min(self.escapes - start);
            let cs = unpack_codes(raw, self.escapes_at, self.index_width, start, n, codes);
            top = top.max(cs.iter().copied().fold(0, u16::max));
            start += n;
        }
        if self.escapes > 0 && top as usize >= d {
            return Err(format!("an escape is not one of the {d} dictionary entries"));
        }
        Ok(())
    }

    /// Check the codes of values `start..start + n` (`start` a multiple of
    /// 8): each a frequent rank or the escape. Returns how many are escapes.
    /// With a full frequent table (every code but the escape a rank) and
    /// codes of up to 8 bits, only the escapes are counted, from the packed
    /// bits ([`count_escapes`]); otherwise the codes are unpacked into
    /// `codes` first, then checked by a branch-free reduction over them (see
    /// [`code_stats`]).
    pub(crate) fn check_codes(
        &self,
        raw: &[u8],
        codes: &mut Vec<u16>,
        start: usize,
        n: usize,
    ) -> Result<usize, String> {
        debug_assert!(start.is_multiple_of(8) && start + n <= self.count);
        let k = self.code_width;
        if k == 0 {
            return Ok(n);
        }
        let frequent = self.frequent as u32;
        if frequent == (1 << k) - 1 && k <= 8 {
            // Every code is a frequent rank or the escape: only the escapes
            // need counting, straight from the packed bits.
            let escapes = count_escapes(raw, self.codes_at + start / 8 * k as usize, k, n);
            if self.escapes == 0 && escapes > 0 {
                return Err(format!("a code is not one of the {frequent} frequent values"));
            }
            return Ok(escapes);
        }
        let cs = unpack_codes(raw, self.codes_at, k, start, n, codes);
        let (escapes, top) = code_stats(cs, k);
        let bad = top > frequent;
        if self.escapes == 0 && (bad || escapes > 0) {
            return Err(format!("a code is not one of the {frequent} frequent values"));
        }
        if bad {
            return Err(format!("a code is neither one of the {frequent} frequent values nor the escape"));
        }
        Ok(escapes)
    }

    /// Check this column of time deltas (every code, escape and the escape
    /// count) and sum it from `first`, a chunk of codes at a time, pushing a [`Mark`] onto
    /// `marks` (its `esc[0]`) every [`CHUNK`] samples of the block's
    /// `self.count + 1`. Returns the earliest, latest and last time.
    pub(crate) fn check_times(
        &self,
        raw: &[u8],
        bufs: &mut DecodeBufs,
        first: u64,
        marks: &mut Vec<Mark>,
    ) -> Result<(u64, u64, u64), String> {
        let (k, wi, m, d) = (self.code_width, self.index_width, self.escapes, self.dict.len());
        let (mut t, mut lo, mut hi) = (first, first, first);
        let samples = self.count + 1;
        let chunks = samples.div_ceil(CHUNK);
        // The escapes' values, once for the block, and a zero that surplus
        // escape codes (an error, reported below) read.
        let mut top = 0u32;
        bufs.escaped.clear();
        if d > 0 {
            let dict = &self.dict[..];
            bufs.escaped.reserve(m + 1);
            let out = &mut bufs.escaped;
            with_width!(wi, W => fields::<W, ()>(raw, self.escapes_at, &mut vec![(); m][..], |i| {
                top = top.max(i);
                out.push(dict[(i as usize).min(d - 1)]);
            }));
        }
        bufs.escaped.push(0);
        if m > 0 && top as usize >= d {
            return Err(format!("an escape is not one of the {d} dictionary entries"));
        }
        let escaped = &bufs.escaped[..];
        if k == 0 {
            // Every value an escape, in order.
            for c in 0..chunks {
                marks.push(Mark { time: t, esc: [(c * CHUNK) as u32, 0, 0] });
                let (s, e) = (c * CHUNK, ((c + 1) * CHUNK).min(self.count));
                for &v in escaped.get(s..e).unwrap_or(&[]) {
                    t = t.wrapping_add(v);
                    lo = lo.min(t);
                    hi = hi.max(t);
                }
            }
            return Ok((lo, hi, t));
        }
        // Codes of `k` bits: each chunk's unpacked into `bufs.codes`, then
        // summed `GROUP` at a time. Code `2^k - 1` (the escape) and the
        // unused codes from `frequent` on read 0 from the table, and a
        // group's escapes are the next ones of `escaped`: its sum is that of
        // its table values and of those escapes. A group of deltas below
        // 2^40 whose sum does not carry the time past 2^64 - 1 only moves
        // time forward: its latest time is its last, its earliest the time
        // before it (already counted). Any other group (a delta that is
        // negative as a signed number, or huge) is summed one time at a time.
        const GROUP: usize = 16;
        let table = &self.table[..1 << k];
        debug_assert!(table[(1 << k) - 1] == 0);
        let frequent = self.frequent as u32;
        let esc_code = ((1u32 << k) - 1) as u16;
        // Whether no table value can move time back (or far): then only the
        // escapes' values need that test.
        let table_small = table.iter().all(|&v| v >> 40 == 0);
        let (mut j, mut top) = (0usize, 0u32);
        // One chunk's codes `$cs` (bytes or unpacked), group by group.
        macro_rules! sum_groups {
            ($cs:expr) => {
                for group in $cs.chunks(GROUP) {
                    let ne = group.iter().map(|&x| (u16::from(x) == esc_code) as u16).sum::<u16>() as usize;
                    let (mut sum, mut or) = (0u64, 0u64);
                    with_width!(k, W => {
                        // Codes are below 2^W: no bounds check in the loop.
                        let tab: &[u64; 1 << W] = table.try_into().expect("2^k entries");
                        if table_small {
                            for &x in group {
                                sum = sum.wrapping_add(tab[usize::from(x) & ((1 << W) - 1)]);
                            }
                        } else {
                            for &x in group {
                                let v = tab[usize::from(x) & ((1 << W) - 1)];
                                sum = sum.wrapping_add(v);
                                or |= v;
                            }
                        }
                    });
                    for &v in escaped.get(j.min(m)..(j + ne).min(m)).unwrap_or(&[]) {
                        sum = sum.wrapping_add(v);
                        or |= v;
                    }
                    match t.checked_add(sum) {
                        Some(end) if or >> 40 == 0 => {
                            hi = hi.max(end);
                            t = end;
                        }
                        _ => {
                            let mut jj = j;
                            for &x in group {
                                let v = if u16::from(x) == esc_code {
                                    jj += 1;
                                    escaped[(jj - 1).min(m)]
                                } else {
                                    table[usize::from(x)]
                                };
                                t = t.wrapping_add(v);
                                lo = lo.min(t);
                                hi = hi.max(t);
                            }
                        }
                    }
                    j += ne;
                }
            };
        }
        let mut codes = std::mem::take(&mut bufs.codes);
        for c in 0..chunks {
            marks.push(Mark { time: t, esc: [j as u32, 0, 0] });
            let (s, e) = (c * CHUNK, ((c + 1) * CHUNK).min(self.count));
            if s >= e {
                continue;
            }
            // Codes of 8 bits are the bytes themselves; others are
            // unpacked first.
            if k == 8 {
                let cs = &raw[self.codes_at + s..self.codes_at + e];
                top = top.max(code_stats(cs, k).1);
                sum_groups!(cs);
            } else {
                let cs = unpack_codes(raw, self.codes_at, k, s, e - s, &mut codes);
                top = top.max(code_stats(cs, k).1);
                sum_groups!(cs);
            }
        }
        bufs.codes = codes;
        let bad = top > frequent;
        if m == 0 && (bad || j > 0) {
            return Err(format!("a code is not one of the {frequent} frequent values"));
        }
        if bad {
            return Err(format!("a code is neither one of the {frequent} frequent values nor the escape"));
        }
        if j != m {
            return Err(format!("{j} escape codes for {m} escapes"));
        }
        Ok((lo, hi, t))
    }

    /// Values `start..start + out.len()` (`start` a multiple of 8) as
    /// `map(v)` into `out`, `esc_start` escape codes coming before `start`:
    /// for a column already checked ([`check_codes`](Self::check_codes),
    /// [`check_escapes`](Self::check_escapes) and the escape count), so
    /// nothing is checked here; out-of-range fields (impossible after those
    /// checks) read as some dictionary value, never out of bounds.
    #[inline(always)]
    pub(crate) fn decode_range<T>(
        &self,
        raw: &[u8],
        bufs: &mut DecodeBufs,
        start: usize,
        esc_start: usize,
        out: &mut [T],
        mut map: impl FnMut(u64) -> T,
    ) {
        let (k, wi, n) = (self.code_width, self.index_width, out.len());
        let d = self.dict.len();
        debug_assert!(start.is_multiple_of(8) && start + n <= self.count);
        if n == 0 || d == 0 {
            return;
        }
        let dict = &self.dict[..];
        if k == 0 {
            let at = |w: usize| self.escapes_at + start / 8 * w;
            with_width!(wi, W => fields::<W, T>(raw, at(W), out, |x| map(dict[(x as usize).min(d - 1)])));
            return;
        }
        let table = &self.table[..1 << k];
        let at = |w: usize| self.codes_at + start / 8 * w;
        if self.escapes == 0 {
            with_width!(k, W => fields::<W, T>(raw, at(W), out, |c| map(table[c as usize & ((1 << W) - 1)])));
            return;
        }
        // The escapes from `esc_start` on (at most one per value), unpacked
        // from the 8-field group it is in.
        let base = esc_start.min(self.escapes) & !7;
        let skip = esc_start.min(self.escapes) - base;
        let window = (self.escapes - base).min(skip + n);
        // Their values, then zeros up to one per value past `skip`.
        if bufs.escaped.len() < skip + n + 1 {
            bufs.escaped.resize(skip + n + 1, 0);
        }
        let esc_at = self.escapes_at + base / 8 * wi as usize;
        let (values, zeros) = bufs.escaped.split_at_mut(window);
        with_width!(wi, W => fields::<W, u64>(raw, esc_at, values, |i| dict[(i as usize).min(d - 1)]));
        zeros.fill(0);
        let escaped = &bufs.escaped[skip..];
        let mut j = 0usize;
        with_width!(k, W => fields::<W, T>(raw, at(W), out, |code| {
            let is_esc = code == (1u32 << W) - 1;
            let (e, f) = (escaped[j], table[code as usize & ((1 << W) - 1)]);
            let keep_e = (is_esc as u64).wrapping_neg();
            j += is_esc as usize;
            map((e & keep_e) | (f & !keep_e))
        }));
    }

    /// Every value `v` of the column, in order, as `map(v)` into `out`
    /// (exactly as long as the column; every element is written, also when
    /// this fails), using `bufs` for the escapes. The codes are checked as
    /// they go (each a frequent rank or the escape, the escapes as many as
    /// announced, each a dictionary index) without a branch on them: a bad
    /// one is noted and reported once the loop is done.
    #[inline(always)]
    pub(crate) fn decode_into<T>(
        &self,
        raw: &[u8],
        bufs: &mut DecodeBufs,
        out: &mut [T],
        mut map: impl FnMut(u64) -> T,
    ) -> Result<(), String> {
        let (k, wi, m) = (self.code_width, self.index_width, self.escapes);
        let d = self.dict.len();
        assert_eq!(out.len(), self.count);
        if self.count == 0 {
            return Ok(());
        }
        let bad_index = || Err(format!("an escape is not one of the {d} dictionary entries"));
        if k == 0 {
            // Every value an escape: plain dictionary indices.
            let dict = &self.dict[..];
            let mut top = 0u32;
            with_width!(wi, W => fields::<W, T>(raw, self.escapes_at, out, |x| {
                top = top.max(x);
                map(dict[(x as usize).min(d - 1)])
            }));
            return if top as usize >= d { bad_index() } else { Ok(()) };
        }
        let table = &self.table[..1 << k];
        if m == 0 {
            // No escapes: every code a frequent rank.
            let mut top = 0u32;
            with_width!(k, W => fields::<W, T>(raw, self.codes_at, out, |c| {
                top = top.max(c);
                map(table[c as usize & ((1 << W) - 1)])
            }));
            if top as usize >= self.frequent {
                return Err(format!("a code is not one of the {} frequent values", self.frequent));
            }
            return Ok(());
        }
        let esc_idx = unpack(raw, self.escapes_at, wi, m, &mut bufs.escapes);
        let bad = esc_idx.iter().copied().max().is_some_and(|i| i as usize >= d);
        // The escapes' values, then zeros up to one per code, so that
        // surplus escape codes (an error, reported below) read inside it.
        bufs.escaped.clear();
        bufs.escaped.extend(esc_idx.iter().map(|&i| self.dict[(i as usize).min(d - 1)]));
        bufs.escaped.resize(self.count + 1, 0);
        let escaped = &bufs.escaped[..];
        let frequent = self.frequent as u32;
        let (mut j, mut bad_code) = (0usize, false);
        with_width!(k, W => fields::<W, T>(raw, self.codes_at, out, |code| {
            // Both candidates loaded and one kept by a mask: a branch here
            // would be mispredicted at every escape.
            let esc = (1u32 << W) - 1;
            let is_esc = code == esc;
            bad_code |= !is_esc & (code >= frequent);
            let (e, f) = (escaped[j], table[code as usize & ((1 << W) - 1)]);
            let keep_e = (is_esc as u64).wrapping_neg();
            j += is_esc as usize;
            map((e & keep_e) | (f & !keep_e))
        }));
        if bad {
            return bad_index();
        }
        if bad_code {
            return Err(format!("a code is neither one of the {frequent} frequent values nor the escape"));
        }
        if j != m {
            return Err(format!("{j} escape codes for {m} escapes"));
        }
        Ok(())
    }
}

/// Reusable buffers for [`Column::decode_into`].
#[derive(Debug, Default, Clone)]
pub(crate) struct DecodeBufs {
    pub(super) escapes: Vec<u32>,
    pub(super) escaped: Vec<u64>,
    /// One chunk's codes, unpacked (`check_block`).
    pub(super) codes: Vec<u16>,
}
