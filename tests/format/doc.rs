//! Keeps FORMAT.md honest: the worked example's hex dump must be exactly what
//! `SpoolWriter` produces for the records the document describes, with the
//! offsets the document states, and must decode to the values it states.

use spulse::{Frame, Header, NewModule, Snapshot, SpoolWriter};

const START: u64 = 1_700_000_000_000_000;

/// The example file of FORMAT.md, built with the writer, and the offset at which
/// each record (header first) starts.
fn example() -> (Vec<u8>, Vec<u64>) {
    let header = Header { start_time_us: START, interval_us: 1000 };
    let mut w = SpoolWriter::new(Vec::new(), header).unwrap();
    let mut starts = vec![0, w.len()];
    let mut mark = |w: &SpoolWriter<Vec<u8>>| starts.push(w.len());
    let m = w
        .define_module(&NewModule {
            pid: 4242,
            start: 0x5555_0000,
            size: 0x2000,
            file_offset: 0x1000,
            generation: 1,
            path: b"/bin/app",
            build_id: &[0xde, 0xad, 0xbe, 0xef],
        })
        .unwrap();
    mark(&w);
    let f0 = w.define_frame(Frame::Module { module: m, file_relative: 0x1234 }).unwrap();
    mark(&w);
    let f1 = w.define_frame(Frame::Absolute { address: 0xffff_ffff_8100_0000, kernel: true }).unwrap();
    mark(&w);
    let f2 = w.define_frame(Frame::Truncated).unwrap();
    mark(&w);
    let s0 = w.define_stack(None, f2).unwrap();
    mark(&w);
    let s1 = w.define_stack(Some(s0), f0).unwrap();
    mark(&w);
    let s2 = w.define_stack(Some(s1), f1).unwrap();
    mark(&w);
    let t = w.define_thread(4242, 4243, "main").unwrap();
    mark(&w);
    w.sample(START + 1000, t, s2).unwrap();
    mark(&w);
    w.sample(START + 500, t, s1).unwrap();
    mark(&w);
    w.python_runtime(4242, START + 2000, true).unwrap();
    mark(&w);
    w.deactivate_module(m).unwrap();
    mark(&w);
    w.deactivate_process_modules(4242).unwrap();
    mark(&w);
    w.sample(START + 3000, t, s0).unwrap();
    mark(&w);
    let bytes = w.into_inner().unwrap();
    starts.pop();
    (bytes, starts)
}

/// Parse the first ```text block after the "Worked example" heading: lines of
/// `OFFSET | HEX BYTES | comment`.
fn dump_from_doc() -> Vec<(u64, Vec<u8>)> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/FORMAT.md")).unwrap();
    let section = &doc[doc.find("Worked example\n").expect("FORMAT.md has a worked example")..];
    let block = &section[section.find("```text\n").expect("hex block") + 8..];
    let block = &block[..block.find("```").unwrap()];
    let mut rows = Vec::new();
    for line in block.lines().filter(|l| !l.trim().is_empty()) {
        let cols: Vec<&str> = line.split('|').collect();
        assert!(cols.len() >= 2, "bad dump line {line:?}");
        let offset = u64::from_str_radix(cols[0].trim(), 16).unwrap_or_else(|_| panic!("offset in {line:?}"));
        let bytes = cols[1]
            .split_whitespace()
            .map(|h| u8::from_str_radix(h, 16).unwrap_or_else(|_| panic!("byte {h:?} in {line:?}")))
            .collect();
        rows.push((offset, bytes));
    }
    rows
}

#[test]
fn format_md_hex_dump_matches_the_writer() {
    let (bytes, starts) = example();
    let rows = dump_from_doc();
    let doc_bytes: Vec<u8> = rows.iter().flat_map(|(_, b)| b.iter().copied()).collect();
    assert_eq!(doc_bytes, bytes, "FORMAT.md's dump differs from SpoolWriter's output");
    // Each row's offset is right, and rows are whole records (the header split in fields).
    let mut at = 0u64;
    for (offset, b) in &rows {
        assert_eq!(*offset, at, "offset column");
        at += b.len() as u64;
    }
    for s in &starts {
        assert!(rows.iter().any(|(o, _)| o == s), "a record starting at {s:#x} should start a row");
    }
}

#[test]
fn format_md_example_decodes_as_described() {
    let (bytes, _) = example();
    let snap = Snapshot::from_bytes(&bytes).unwrap();
    assert_eq!(snap.len(), 3);
    let times: Vec<u64> = snap.samples().map(|s| s.time_us - START).collect();
    assert_eq!(times, [1000, 500, 3000]);
    let leaf = snap.sample(0).stack;
    let frames: Vec<Frame> = snap.stack_frames(leaf).map(|f| snap.frame(f)).collect();
    assert_eq!(frames[0], Frame::Absolute { address: 0xffff_ffff_8100_0000, kernel: true });
    assert_eq!(frames[2], Frame::Truncated);
    assert_eq!(snap.frame_address(snap.frame_id(0).unwrap()), Some(0x5555_0234));
    assert_eq!(snap.deactivations().len(), 1);
    assert!(!snap.is_module_active(snap.modules()[0].id));
    assert_eq!(snap.python_runtime_events()[0].samples_before, 2);

    // The claims of the paragraph after the dump.
    let cut = Snapshot::from_bytes(&bytes[..0x5f]).unwrap();
    assert!(cut.recovered_from_truncated_tail() && cut.is_empty() && cut.valid_len() == 0x5d);
    let cut = Snapshot::from_bytes(&bytes[..0x62]).unwrap();
    assert!(!cut.recovered_from_truncated_tail() && cut.len() == 1);
    let mut bad = bytes.clone();
    bad[0x60] = 0x01;
    let e = Snapshot::from_bytes(&bad).unwrap_err();
    assert_eq!(e.format_kind(), Some(&spulse::FormatErrorKind::UndefinedReference { what: "thread", id: 1 }));
    assert_eq!(e.offset(), Some(0x5d));
}

/// Prints the dump in FORMAT.md's layout (run with --nocapture to regenerate).
#[test]
fn print_example_dump() {
    let (bytes, starts) = example();
    let mut ends = starts.clone();
    ends.push(bytes.len() as u64);
    for w in ends.windows(2) {
        let hex: Vec<String> =
            bytes[w[0] as usize..w[1] as usize].iter().map(|b| format!("{b:02x}")).collect();
        println!("{:04x} | {} |", w[0], hex.join(" "));
    }
}
