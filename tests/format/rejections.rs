//! One test per rejection rule. Each builds a valid prefix with `SpoolWriter`,
//! appends a hand-encoded bad record and checks that `Snapshot`, `Replay` and
//! `Tail` all reject it with the expected error kind at the expected absolute
//! byte offset; that every cut of the bad record either reads as a recovered
//! truncation or fails with that same error (never a different one, and never
//! "recovered" once the offending field is complete); and that the writer
//! refuses the same record where its API can express it.

use spulse::{Error, FormatErrorKind as K, Frame, Header, NewModule, Replay, Snapshot, SpoolWriter, Tail};
use spulse_testkit::spool::temp_file;

const START: u64 = 1_000_000;

/// A hand-encoded field.
enum F<'a> {
    U(u64),
    I(i64),
    Raw(&'a [u8]),
}
use F::*;

fn uvar(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn rec(tag: u8, fields: &[F]) -> Vec<u8> {
    let mut out = vec![tag];
    for f in fields {
        match f {
            U(v) => uvar(*v, &mut out),
            I(v) => uvar(((v << 1) ^ (v >> 63)) as u64, &mut out),
            Raw(b) => out.extend_from_slice(b),
        }
    }
    out
}

/// A writer with one module (pid 7, [0x10000, 0x11000), file offset 0x2000),
/// one module frame, one absolute frame, one root stack and one thread.
fn base() -> SpoolWriter<Vec<u8>> {
    let mut w = SpoolWriter::new(Vec::new(), Header { start_time_us: START, interval_us: 1000 }).unwrap();
    let m = w
        .define_module(&NewModule {
            pid: 7,
            start: 0x10000,
            size: 0x1000,
            file_offset: 0x2000,
            generation: 0,
            path: b"/bin/x",
            build_id: b"",
        })
        .unwrap();
    let f = w.define_frame(Frame::Module { module: m, file_relative: 0x2010 }).unwrap();
    w.define_frame(Frame::Absolute { address: 0xffff_8000_0000_0000, kernel: true }).unwrap();
    let s = w.define_stack(None, f).unwrap();
    let t = w.define_thread(7, 8, "main").unwrap();
    w.sample(START + 1000, t, s).unwrap();
    w
}

/// Assert that `prefix ++ bad` is rejected by every reader with `kind` at
/// `prefix.len() + rel`, and that every cut of `bad` is either a recovered
/// truncation or that same error.
fn rejects(prefix: Vec<u8>, bad: &[u8], kind: K, rel: u64) {
    let mut bytes = prefix.clone();
    bytes.extend_from_slice(bad);
    let offset = prefix.len() as u64 + rel;
    let check = |e: Error, who: &str| {
        assert_eq!(e.format_kind(), Some(&kind), "{who}: {e}");
        assert_eq!(e.offset(), Some(offset), "{who}: {e}");
        assert!(matches!(e, Error::Format { .. }));
    };
    check(Snapshot::from_bytes(&bytes).unwrap_err(), "snapshot");
    let file = temp_file(&bytes);
    check(Replay::open(file.path()).unwrap_err(), "replay");
    let mut tail = Tail::open(file.path()).unwrap();
    let mut n = 0;
    let e = loop {
        match tail.poll() {
            Ok([]) => panic!("tail accepted the bad record"),
            Ok(b) => n += b.len(),
            Err(e) => break e,
        }
    };
    check(e, "tail");
    // The error is sticky.
    check(tail.poll().unwrap_err(), "tail again");
    assert_eq!(n as u64, Snapshot::from_bytes(&prefix).unwrap().sample_count());
    for cut in prefix.len()..bytes.len() {
        match Snapshot::from_bytes(&bytes[..cut]) {
            Ok(s) => {
                assert_eq!(s.valid_len(), prefix.len() as u64);
                assert_eq!(s.recovered_from_truncated_tail(), cut > prefix.len());
            }
            Err(e) => check(e, &format!("snapshot cut at {cut}")),
        }
    }
}

fn invalid_record(r: Result<impl std::fmt::Debug, Error>, kind: K) {
    match r {
        Err(Error::InvalidRecord { kind: k, .. }) => assert_eq!(k, kind),
        other => panic!("writer accepted or failed otherwise: {other:?}"),
    }
}

fn prefix() -> Vec<u8> {
    base().into_inner().unwrap()
}

#[test]
fn unknown_tag() {
    rejects(prefix(), &[0], K::UnknownTag(0), 0);
    // Tags 9 and 10 are the off-CPU interval and the heap event (FORMAT.md);
    // 11 and above are unknown.
    rejects(prefix(), &[11, 1, 2], K::UnknownTag(11), 0);
    rejects(prefix(), &[255], K::UnknownTag(255), 0);
}

#[test]
fn overlong_varint() {
    rejects(prefix(), &rec(5, &[Raw(&[0x82, 0x00]), U(0), U(0)]), K::BadVarint, 1);
    rejects(prefix(), &rec(4, &[U(1), U(7), Raw(&[0x80, 0x80, 0x00]), U(0)]), K::BadVarint, 3);
}

#[test]
fn varint_longer_than_ten_bytes_or_overflowing() {
    rejects(prefix(), &rec(5, &[Raw(&[0xff; 11])]), K::BadVarint, 1);
    let mut ten = [0xffu8; 10];
    ten[9] = 0x02;
    rejects(prefix(), &rec(5, &[U(0), Raw(&ten), U(0)]), K::BadVarint, 2);
}

#[test]
fn varint_cut_short_is_incomplete_only_below_ten_continuation_bytes() {
    // Nine continuation bytes at the end of the file: a truncated tail.
    let mut bytes = prefix();
    let len = bytes.len() as u64;
    bytes.extend_from_slice(&rec(5, &[Raw(&[0xff; 9])]));
    let s = Snapshot::from_bytes(&bytes).unwrap();
    assert!(s.recovered_from_truncated_tail());
    assert_eq!(s.valid_len(), len);
    // Ten continuation bytes can never complete: corruption, even at the end.
    rejects(prefix(), &rec(5, &[Raw(&[0xff; 10])]), K::BadVarint, 1);
    // A byte without the continuation bit among the last ones is not a cut varint.
    rejects(prefix(), &rec(5, &[Raw(&[0x80, 0x00])]), K::BadVarint, 1);
}

#[test]
fn non_dense_ids() {
    rejects(prefix(), &rec(1, &[U(5)]), K::NonDenseId { what: "module", found: 5, expected: 1 }, 0);
    rejects(prefix(), &rec(2, &[U(0)]), K::NonDenseId { what: "frame", found: 0, expected: 2 }, 0);
    rejects(prefix(), &rec(3, &[U(3)]), K::NonDenseId { what: "stack", found: 3, expected: 1 }, 0);
    rejects(prefix(), &rec(4, &[U(0)]), K::NonDenseId { what: "thread", found: 0, expected: 1 }, 0);
}

#[test]
fn references_only_backwards() {
    let undefined = |what, id| K::UndefinedReference { what, id };
    rejects(prefix(), &rec(5, &[I(1), U(1), U(0)]), undefined("thread", 1), 0);
    rejects(prefix(), &rec(5, &[I(1), U(0), U(1)]), undefined("stack", 1), 0);
    // A stack whose parent is itself (parent + 1 = 2 names stack 1, being defined).
    rejects(prefix(), &rec(3, &[U(1), U(2), U(0)]), undefined("stack", 1), 0);
    rejects(prefix(), &rec(3, &[U(1), U(0), U(2)]), undefined("frame", 2), 0);
    rejects(prefix(), &rec(2, &[U(2), U(0), U(1), U(0x2010)]), undefined("module", 1), 0);
    rejects(prefix(), &rec(8, &[U(1)]), undefined("module", 1), 0);
}

#[test]
fn address_arithmetic_is_checked() {
    rejects(prefix(), &rec(1, &[U(1), U(9), U(u64::MAX - 10), U(11)]), K::AddressOverflow, 0);
    rejects(prefix(), &rec(1, &[U(1), U(9), U(0), U(16), U(u64::MAX - 3)]), K::AddressOverflow, 0);
    let mut w = base();
    let m = NewModule {
        pid: 9,
        start: u64::MAX - 10,
        size: 11,
        file_offset: 0,
        generation: 0,
        path: b"",
        build_id: b"",
    };
    invalid_record(w.define_module(&m), K::AddressOverflow);
    invalid_record(w.define_module(&NewModule { start: 0, file_offset: u64::MAX, ..m }), K::AddressOverflow);
}

#[test]
fn addresses_inside_their_module() {
    let outside = |address| K::OutsideModule { module: 0, address };
    rejects(prefix(), &rec(2, &[U(2), U(0), U(0), U(0x1fff)]), outside(0x1fff), 0);
    rejects(prefix(), &rec(2, &[U(2), U(0), U(0), U(0x3000)]), outside(0x3000), 0);
    let mut w = base();
    let m = w.definitions().modules()[0].id;
    invalid_record(w.define_frame(Frame::Module { module: m, file_relative: 0x3000 }), outside(0x3000));
    // The last byte of the span is inside.
    w.define_frame(Frame::Module { module: m, file_relative: 0x2fff }).unwrap();
}

#[test]
fn frame_may_not_refer_to_a_retired_module() {
    let mut w = base();
    let m = w.definitions().modules()[0].id;
    w.deactivate_module(m).unwrap();
    invalid_record(w.define_frame(Frame::Module { module: m, file_relative: 0x2010 }), K::RetiredModule(0));
    rejects(w.into_inner().unwrap(), &rec(2, &[U(2), U(0), U(0), U(0x2010)]), K::RetiredModule(0), 0);
    // Retired by a process-wide deactivation, too.
    let mut w = base();
    w.deactivate_process_modules(7).unwrap();
    rejects(w.into_inner().unwrap(), &rec(2, &[U(2), U(0), U(0)]), K::RetiredModule(0), 0);
}

#[test]
fn module_retired_twice() {
    let mut w = base();
    let m = w.definitions().modules()[0].id;
    w.deactivate_module(m).unwrap();
    invalid_record(w.deactivate_module(m), K::AlreadyRetired(0));
    rejects(w.into_inner().unwrap(), &rec(8, &[U(0)]), K::AlreadyRetired(0), 0);
}

#[test]
fn overlapping_active_modules_of_one_pid() {
    let overlap = K::OverlappingModule { active: 0 };
    rejects(prefix(), &rec(1, &[U(1), U(7), U(0x10fff), U(1)]), overlap.clone(), 0);
    rejects(prefix(), &rec(1, &[U(1), U(7), U(0xf000), U(0x1001)]), overlap.clone(), 0);
    rejects(prefix(), &rec(1, &[U(1), U(7), U(0), U(u64::MAX)]), overlap.clone(), 0);
    // Adjacent, another process, or after retirement: accepted.
    let mut w = base();
    let new = |pid, start| NewModule {
        pid,
        start,
        size: 0x1000,
        file_offset: 0,
        generation: 1,
        path: b"",
        build_id: b"",
    };
    w.define_module(&new(7, 0x11000)).unwrap();
    w.define_module(&new(7, 0xf000)).unwrap();
    w.define_module(&new(8, 0x10000)).unwrap();
    // [0x10800, 0x11800) overlaps modules 0 and 1: the one starting last is named.
    invalid_record(w.define_module(&new(7, 0x10800)), K::OverlappingModule { active: 1 });
    invalid_record(w.define_module(&new(7, 0x10800 - 0x1000)), overlap);
    let m0 = w.definitions().modules()[0].id;
    w.deactivate_module(m0).unwrap();
    w.define_module(&new(7, 0x10000)).unwrap();
    let bytes = w.into_inner().unwrap();
    assert_eq!(Snapshot::from_bytes(&bytes).unwrap().modules().len(), 5);
}

#[test]
fn empty_module() {
    rejects(prefix(), &rec(1, &[U(1), U(7), U(0x50000), U(0)]), K::EmptyModule, 0);
}

#[test]
fn string_limits() {
    let too_long = |what, len, limit| K::TooLong { what, len, limit };
    let m = |tail: Vec<u8>| [rec(1, &[U(1), U(9), U(0), U(1), U(0), U(0)]), tail].concat();
    rejects(prefix(), &m(vec![0x81, 0x20]), too_long("module path", 4097, 4096), 7);
    rejects(prefix(), &m(vec![0, 65]), too_long("build id", 65, 64), 8);
    rejects(prefix(), &rec(4, &[U(1), U(1), U(1), U(257)]), too_long("thread name", 257, 256), 4);
    // A huge declared length is rejected without waiting for (or allocating) the bytes.
    rejects(prefix(), &rec(4, &[U(1), U(1), U(1), U(u64::MAX)]), too_long("thread name", u64::MAX, 256), 4);
    let mut w = base();
    invalid_record(w.define_thread(1, 1, &"x".repeat(257)), too_long("thread name", 257, 256));
    let big = vec![b'a'; 5000];
    let nm =
        NewModule { pid: 1, start: 0, size: 1, file_offset: 0, generation: 0, path: &big, build_id: b"" };
    invalid_record(w.define_module(&nm), too_long("module path", 5000, 4096));
    w.define_thread(1, 1, &"x".repeat(256)).unwrap();
}

#[test]
fn thread_name_utf8() {
    rejects(prefix(), &rec(4, &[U(1), U(1), U(1), U(3), Raw(b"a\xffb")]), K::BadUtf8("thread name"), 4);
    // A cut inside a multi-byte character is a truncated tail ...
    let mut bytes = prefix();
    bytes.extend_from_slice(&rec(4, &[U(1), U(1), U(1), U(4), Raw("aé".as_bytes())])[..7]);
    assert!(Snapshot::from_bytes(&bytes).unwrap().recovered_from_truncated_tail());
    // ... but a prefix that is already invalid is corruption, at the end of the file too.
    let mut bytes = prefix();
    let at = bytes.len() as u64 + 4;
    bytes.extend_from_slice(&rec(4, &[U(1), U(1), U(1), U(10), Raw(b"ab\xc3(")]));
    let e = Snapshot::from_bytes(&bytes).unwrap_err();
    assert_eq!((e.format_kind(), e.offset()), (Some(&K::BadUtf8("thread name")), Some(at)));
}

#[test]
fn stack_depth_limit() {
    let mut w = base();
    let f = w.definitions().frame_id(1).unwrap();
    let mut s = w.define_stack(None, f).unwrap();
    for _ in 1..4096 {
        s = w.define_stack(Some(s), f).unwrap();
    }
    assert_eq!(w.definitions().stack_depth(s), 4096);
    invalid_record(w.define_stack(Some(s), f), K::StackTooDeep);
    let next = w.definitions().stack_count() as u64;
    rejects(w.into_inner().unwrap(), &rec(3, &[U(next), U(next), U(1)]), K::StackTooDeep, 0);
}

#[test]
fn truncation_marker_only_as_root() {
    let mut w = base();
    let marker = w.define_frame(Frame::Truncated).unwrap();
    let root = w.define_stack(None, marker).unwrap();
    let f = w.definitions().frame_id(0).unwrap();
    // A marker root with callees is fine.
    w.define_stack(Some(root), f).unwrap();
    invalid_record(w.define_stack(Some(root), marker), K::MisplacedTruncationMarker);
    let s = w.definitions().stack_count() as u64;
    rejects(w.into_inner().unwrap(), &rec(3, &[U(s), U(1), U(2)]), K::MisplacedTruncationMarker, 0);
    rejects(prefix(), &rec(2, &[U(2), U(2), U(1)]), K::BadTruncationMarker, 3);
}

#[test]
fn unknown_values() {
    // Frame kind 3 is the label frame (FORMAT.md); 4 and above are unknown.
    rejects(prefix(), &rec(2, &[U(2), U(4), U(0)]), K::UnknownFrameKind(4), 2);
    rejects(prefix(), &rec(9, &[U(0), U(0), U(5), U(7), U(2)]), K::BadValue("off-CPU state", 2), 5);
    rejects(prefix(), &rec(2, &[U(2), U(1), U(0x1234), U(2)]), K::BadValue("frame mode bit", 2), 5);
    rejects(prefix(), &rec(6, &[U(7), U(5), U(2)]), K::BadValue("Python-runtime state", 2), 3);
    let big = 1u64 << 32;
    rejects(prefix(), &rec(4, &[U(1), U(big)]), K::BadValue("pid", big), 0);
    rejects(prefix(), &rec(4, &[U(1), U(1), U(big)]), K::BadValue("tid", big), 0);
    rejects(prefix(), &rec(1, &[U(1), U(big)]), K::BadValue("pid", big), 0);
    rejects(prefix(), &rec(6, &[U(big)]), K::BadValue("pid", big), 0);
    rejects(prefix(), &rec(7, &[U(big)]), K::BadValue("pid", big), 0);
}

#[test]
fn header_fields() {
    // The header ends after the interval: the next byte is a record tag.
    let e = Snapshot::from_bytes(b"SPULSE3\0\x01\x02\x0b").unwrap_err();
    assert_eq!((e.format_kind(), e.offset()), (Some(&K::UnknownTag(11)), Some(10)));
    let e = Snapshot::from_bytes(b"SPULSE3\0\x01\x82\x00\x00").unwrap_err();
    assert_eq!((e.format_kind(), e.offset()), (Some(&K::BadVarint), Some(9)));
    let e = Snapshot::from_bytes(b"SPULSE4\0\x01\x02").unwrap_err();
    assert_eq!((e.format_kind(), e.offset()), (Some(&K::BadMagic), Some(0)));
}

/// A spool assembled byte by byte from seed 001's header (magic, start time,
/// requested interval, and nothing else) reads in every reader, and the
/// writer's header is exactly those bytes.
#[test]
fn seed_header_is_magic_start_and_interval_only() {
    let mut bytes = b"SPULSE3\0".to_vec();
    uvar(START, &mut bytes);
    uvar(1000, &mut bytes);
    let header_len = bytes.len();
    let written = SpoolWriter::new(Vec::new(), Header { start_time_us: START, interval_us: 1000 })
        .unwrap()
        .into_inner()
        .unwrap();
    assert_eq!(written, bytes, "the writer's header is the seed's");
    // A thread, an absolute frame, a root stack, then a sample right after them.
    bytes.extend(rec(4, &[U(0), U(7), U(8), U(4), Raw(b"main")]));
    bytes.extend(rec(2, &[U(0), U(1), U(0x1000), U(0)]));
    bytes.extend(rec(3, &[U(0), U(0), U(0)]));
    bytes.extend(rec(5, &[I(250), U(0), U(0)]));
    let snap = Snapshot::from_bytes(&bytes).unwrap();
    assert_eq!((snap.start_time_us(), snap.interval_us()), (START, 1000));
    assert!(!snap.recovered_from_truncated_tail());
    assert_eq!(snap.sample_times().collect::<Vec<_>>(), [START + 250]);
    assert_eq!(snap.thread(snap.sample(0).thread).name, "main");
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), &bytes).unwrap();
    let replay = Replay::open(file.path()).unwrap();
    assert_eq!(replay.samples().map(|s| s.unwrap().time_us).collect::<Vec<_>>(), [START + 250]);
    let mut tail = Tail::open(file.path()).unwrap();
    assert_eq!(tail.poll().unwrap().len(), 1);
    assert_eq!(tail.position(), bytes.len() as u64);
    // The header alone is a valid, empty spool.
    let empty = Snapshot::from_bytes(&bytes[..header_len]).unwrap();
    assert!(empty.is_empty() && !empty.recovered_from_truncated_tail());
}

#[test]
fn timestamps_stay_in_range() {
    // The previous sample is at START + 1000.
    rejects(prefix(), &rec(5, &[I(-(START as i64) - 1001), U(0), U(0)]), K::TimestampOverflow, 0);
    let mut w = base();
    let t = w.definitions().threads()[0].id;
    let s = w.definitions().stack_id(0).unwrap();
    // A delta beyond i64 cannot be written; two steps reach the top of u64.
    invalid_record(w.sample(u64::MAX - 5, t, s), K::TimestampOverflow);
    w.sample(i64::MAX as u64, t, s).unwrap();
    w.sample(u64::MAX - 5, t, s).unwrap();
    invalid_record(w.sample(START, t, s), K::TimestampOverflow);
    rejects(w.into_inner().unwrap(), &rec(5, &[I(6), U(0), U(0)]), K::TimestampOverflow, 0);
    // Exactly zero is fine.
    let mut bytes = prefix();
    bytes.extend_from_slice(&rec(5, &[I(-(START as i64) - 1000), U(0), U(0)]));
    assert_eq!(Snapshot::from_bytes(&bytes).unwrap().sample_times().last(), Some(0));
}

#[test]
fn python_runtime_alternates() {
    rejects(prefix(), &rec(6, &[U(7), U(5), U(0)]), K::PythonRuntimeState, 0);
    let mut w = base();
    w.python_runtime(7, 5, true).unwrap();
    invalid_record(w.python_runtime(7, 6, true), K::PythonRuntimeState);
    w.python_runtime(8, 6, true).unwrap();
    rejects(w.into_inner().unwrap(), &rec(6, &[U(7), U(9), U(1)]), K::PythonRuntimeState, 0);
}

#[test]
fn a_partial_record_already_wrong_is_corruption_not_a_truncated_tail() {
    // The sample's thread is complete and undefined; its stack field is missing.
    let mut bytes = prefix();
    let at = bytes.len() as u64;
    bytes.extend_from_slice(&rec(5, &[I(1), U(42)]));
    let e = Snapshot::from_bytes(&bytes).unwrap_err();
    assert_eq!(e.format_kind(), Some(&K::UndefinedReference { what: "thread", id: 42 }));
    assert_eq!(e.offset(), Some(at));
    // A module record whose id is already wrong.
    let mut bytes = prefix();
    bytes.extend_from_slice(&rec(1, &[U(3), U(1)]));
    assert!(Snapshot::from_bytes(&bytes).is_err());
}

#[test]
fn a_rule_on_an_earlier_field_is_reported_before_a_later_syntax_error() {
    // Fields are checked in stream order: a complete field that breaks a rule
    // is the error, whatever follows it; a malformed field is the error when
    // every field before it is valid. One case per record kind.
    let overlong = Raw(&[0x80, 0x00]);
    let big = 1u64 << 32;
    let undefined = |what, id| K::UndefinedReference { what, id };
    rejects(prefix(), &rec(5, &[I(1), U(42), Raw(&[0x80, 0x00])]), undefined("thread", 42), 0);
    rejects(prefix(), &rec(5, &[I(1), Raw(&[0x80, 0x00]), U(42)]), K::BadVarint, 2);
    rejects(
        prefix(),
        &rec(1, &[U(5), U(7), U(0x20000), U(1), U(0), U(0), U(5000)]),
        K::NonDenseId { what: "module", found: 5, expected: 1 },
        0,
    );
    rejects(prefix(), &rec(1, &[U(1), U(7), U(0x20000), U(0), U(0), Raw(&[0x80, 0x00])]), K::EmptyModule, 0);
    rejects(prefix(), &rec(2, &[U(2), U(0), U(9), Raw(&[0x80, 0x00])]), undefined("module", 9), 0);
    rejects(prefix(), &rec(2, &[U(9), U(3)]), K::NonDenseId { what: "frame", found: 9, expected: 2 }, 0);
    rejects(prefix(), &rec(3, &[U(1), U(6), overlong]), undefined("stack", 5), 0);
    rejects(prefix(), &rec(4, &[U(1), U(1), U(big), U(1), Raw(b"\xff")]), K::BadValue("tid", big), 0);
    rejects(prefix(), &rec(4, &[U(1), U(1), U(1), U(1), Raw(b"\xff")]), K::BadUtf8("thread name"), 4);
    rejects(prefix(), &rec(6, &[U(big), U(1), U(2)]), K::BadValue("pid", big), 0);
    rejects(prefix(), &rec(8, &[U(3)]), undefined("module", 3), 0);
}

#[test]
fn rejected_writes_leave_no_bytes_and_the_writer_usable() {
    let mut w = base();
    let before = w.len();
    let t = w.definitions().threads()[0].id;
    invalid_record(w.python_runtime(7, 1, false), K::PythonRuntimeState);
    let nm = NewModule {
        pid: 7,
        start: 0x10000,
        size: 1,
        file_offset: 0,
        generation: 0,
        path: b"",
        build_id: b"",
    };
    invalid_record(w.define_module(&nm), K::OverlappingModule { active: 0 });
    invalid_record(w.define_module(&NewModule { start: 0, size: 0, ..nm }), K::EmptyModule);
    assert_eq!(w.len(), before, "rejected records left bytes behind");
    let f = w.definitions().frame_id(0).unwrap();
    let s = w.define_stack(None, f).unwrap();
    assert_eq!(w.len(), before + 4, "the valid stack was written");
    w.sample(START + 5000, t, s).unwrap();
    let bytes = w.into_inner().unwrap();
    let snap = Snapshot::from_bytes(&bytes).unwrap();
    assert_eq!(snap.len(), 2);
    assert!(!snap.recovered_from_truncated_tail());
}

#[test]
fn error_messages_name_the_offset() {
    let mut bytes = prefix();
    let at = bytes.len();
    bytes.push(0xee);
    let file = temp_file(&bytes);
    let msg = Replay::open(file.path()).unwrap_err().to_string();
    assert!(msg.contains(&format!("byte offset {at}")) && msg.contains("unknown record tag 238"), "{msg}");
    assert!(msg.contains(&file.path().display().to_string()), "{msg}");
}
