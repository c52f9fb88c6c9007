//! `spulse pack` with the real binary: every command reads the packed file as
//! it reads the spool, `info` names the container, the output never replaces
//! the input and is never left half-written, and a damaged packed file is an
//! error naming the byte offset.

mod common;

use common::*;
use serde_json::Value;

/// Pack the standard fixture; returns the program, spool and packed paths.
fn packed_fixture() -> (Program, std::path::PathBuf, std::path::PathBuf) {
    let (p, spool) = fixture();
    let spk = p.dir.path().join("a.spk");
    let o = spulse(&["pack", s(&spool), "-o", s(&spk)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let msg = stderr(&o);
    assert!(msg.contains("spulse: pack: 400 samples in 1 block written to"), "{msg}");
    (p, spool, spk)
}

#[test]
fn every_command_reads_the_packed_file_as_the_spool() {
    let (p, spool, spk) = packed_fixture();
    assert!(std::fs::read(&spk).unwrap().starts_with(b"SPULSPK3"));
    for args in [
        &["top", "--json"][..],
        &["top", "--json", "--thread", "1002"],
        &["top", "--json", "--from", "100000", "--to", "200000"],
        &["top", "--sort", "total"],
    ] {
        let a = ok(&[&[args[0], s(&spool)], &args[1..]].concat());
        let b = ok(&[&[args[0], s(&spk)], &args[1..]].concat());
        assert_eq!(a, b, "{args:?}");
    }
    // Exports name their input, so the packed copy gets a name as long as the
    // spool's, and the two outputs are compared with the names replaced.
    let same_len = p.dir.path().join("b.spool");
    std::fs::copy(&spk, &same_len).unwrap();
    for format in ["collapsed", "pprof", "speedscope", "svg", "firefox"] {
        let (oa, ob) = (p.dir.path().join(format!("a.{format}")), p.dir.path().join(format!("b.{format}")));
        ok(&["export", s(&spool), "--format", format, "-o", s(&oa), "--from", "1000"]);
        ok(&["export", s(&same_len), "--format", format, "-o", s(&ob), "--from", "1000"]);
        let read = |path: &std::path::Path| {
            let bytes = std::fs::read(path).unwrap();
            if format != "pprof" {
                return bytes;
            }
            let mut out = Vec::new();
            std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&bytes[..]), &mut out).unwrap();
            out
        };
        let a = String::from_utf8_lossy(&read(&oa)).replace(s(&spool), "IN");
        let b = String::from_utf8_lossy(&read(&ob)).replace(s(&same_len), "IN");
        assert_eq!(a, b, "{format}");
    }
    let folded = std::fs::read_to_string(p.dir.path().join("b.collapsed")).unwrap();
    assert!(folded.contains("hot_a"), "{folded}");

    // info: the same counts, and the container.
    let a: Value = serde_json::from_str(&ok(&["info", s(&spool), "--json"])).unwrap();
    let b: Value = serde_json::from_str(&ok(&["info", s(&spk), "--json"])).unwrap();
    for key in
        ["samples", "threads", "modules", "frames", "stacks", "duration_us", "thread_list", "module_list"]
    {
        assert_eq!(a[key], b[key], "{key}");
    }
    assert_eq!(a["container"], "spool");
    assert_eq!(a["compression_ratio"], Value::Null);
    assert_eq!(b["container"], "packed");
    assert_eq!(b["packed_blocks"], 1);
    let ratio = b["compression_ratio"].as_f64().unwrap();
    assert!(ratio > 1.0, "400 samples of 3 stacks and 2 threads compress: {ratio}");
    let text = ok(&["info", s(&spk)]);
    assert!(text.contains("container:       packed, 1 block(s), compression ratio"), "{text}");
    assert!(text.contains("6400 bytes of sample columns"), "{text}");
    assert!(ok(&["info", s(&spool)]).contains("container:       spool"));
}

#[test]
fn pack_refuses_its_input_as_output_and_a_packed_input() {
    let (p, spool, spk) = packed_fixture();
    let before = std::fs::read(&spool).unwrap();
    let link = p.dir.path().join("hard.spool");
    std::fs::hard_link(&spool, &link).unwrap();
    for out in [&spool, &link] {
        let o = spulse(&["pack", s(&spool), "-o", s(out)]);
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        assert!(stderr(&o).contains("is the input spool"), "{}", stderr(&o));
    }
    assert_eq!(std::fs::read(&spool).unwrap(), before);
    let o = spulse(&["pack", s(&spk), "-o", s(&p.dir.path().join("again.spk"))]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("is already a packed file"), "{}", stderr(&o));
    assert!(!p.dir.path().join("again.spk").exists());
    // Only the outputs are left in the directory: no temporary file.
    let mut names: Vec<String> = std::fs::read_dir(p.dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.retain(|n| n.starts_with('.'));
    assert!(names.is_empty(), "{names:?}");
}

#[test]
fn pack_to_stdout_is_the_same_file() {
    let (_p, spool, spk) = packed_fixture();
    let o = spulse(&["pack", s(&spool), "-o", "-"]);
    assert!(o.status.success());
    assert_eq!(o.stdout, std::fs::read(&spk).unwrap());
}

#[test]
fn follow_refuses_a_packed_file() {
    let (_p, _spool, spk) = packed_fixture();
    let o = spulse(&["follow", s(&spk)]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("never grows"), "{}", stderr(&o));
}

#[test]
fn a_damaged_packed_file_is_an_error_with_its_offset() {
    let (p, _spool, spk) = packed_fixture();
    let bytes = std::fs::read(&spk).unwrap();
    let cut = p.dir.path().join("cut.spk");
    std::fs::write(&cut, &bytes[..bytes.len() - 5]).unwrap();
    for args in [&["info"][..], &["top"], &["export", "--format", "collapsed", "-o", "-"]] {
        let o = spulse(&[&[args[0], s(&cut)], &args[1..]].concat());
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        let e = stderr(&o);
        assert!(e.contains("cut.spk: at byte offset") && e.contains("corrupt packed file"), "{e}");
        assert!(e.contains("truncated"), "{e}");
    }
    // A block's uncompressed length altered: its LZ4 payload (12 bytes
    // further) no longer decodes to that size.
    let mut bad = bytes.clone();
    let le = |b: &[u8]| u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let index_at = le(&bytes[bytes.len() - 32..]);
    let block_at = le(&bytes[index_at..]);
    bad[block_at] ^= 0x10; // the uncompressed length
    let f = p.dir.path().join("bad.spk");
    std::fs::write(&f, &bad).unwrap();
    let o = spulse(&["top", s(&f)]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains(&format!("at byte offset {}: ", block_at + 12)), "{}", stderr(&o));
}

/// A packed file is a complete recording: among several inputs, `info`,
/// `top` and `export` merge it as they merge its spool (they said "nothing
/// to follow: Tail reads spools only" before).
#[test]
fn packed_files_are_accepted_among_several_inputs() {
    let (p, spool, spk) = packed_fixture();
    let copy = p.dir.path().join("copy.spool");
    std::fs::copy(&spool, &copy).unwrap();
    let spk2 = p.dir.path().join("b.spk");
    std::fs::copy(&spk, &spk2).unwrap();
    // The spool with its packed copy reads as the spool with a copy of itself.
    let want: Value = serde_json::from_str(&ok(&["info", s(&spool), s(&copy), "--json"])).unwrap();
    assert_eq!(want["samples"], 800);
    for inputs in [[&spool, &spk], [&spk, &spool], [&spk, &spk2]] {
        let got: Value = serde_json::from_str(&ok(&["info", s(inputs[0]), s(inputs[1]), "--json"])).unwrap();
        for key in ["samples", "threads", "modules", "frames", "stacks", "duration_us", "thread_list"] {
            assert_eq!(got[key], want[key], "{inputs:?}: {key}");
        }
        let top = |a: &std::path::Path, b: &std::path::Path| ok(&["top", "--json", s(a), s(b)]);
        assert_eq!(top(inputs[0], inputs[1]), top(&spool, &copy), "{inputs:?}");
        let export = |a: &std::path::Path, b: &std::path::Path| {
            ok(&["export", s(a), s(b), "--format", "collapsed", "-o", "-"])
        };
        assert_eq!(export(inputs[0], inputs[1]), export(&spool, &copy), "{inputs:?}");
    }
    // A damaged packed file among them is an error naming it.
    let cut = p.dir.path().join("cut.spk");
    let bytes = std::fs::read(&spk).unwrap();
    std::fs::write(&cut, &bytes[..bytes.len() - 5]).unwrap();
    let o = spulse(&["info", s(&spool), s(&cut)]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("cut.spk") && stderr(&o).contains("offset"), "{}", stderr(&o));
}

/// What `pack` and `export` write holds the profile: it is created 0600,
/// like the spool, whatever the umask (it was 0666 less the umask).
#[test]
fn outputs_are_private_whatever_the_umask() {
    use std::os::unix::fs::PermissionsExt;
    let (p, spool, _spk) = packed_fixture();
    let bin = env!("CARGO_BIN_EXE_spulse");
    let cases: [(&str, &[&str]); 3] = [
        ("out.spk", &["pack"]),
        ("out.folded", &["export", "--format", "collapsed"]),
        ("out.jslb", &["export", "--format", "firefox"]),
    ];
    for (name, cmd) in cases {
        let out = p.dir.path().join(name);
        for existing in [false, true] {
            if existing {
                // Replacing an output that was readable by everyone.
                std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o644)).unwrap();
            }
            let args: Vec<&str> = [cmd, &[s(&spool), "-o", s(&out)]].concat();
            let o = std::process::Command::new("sh")
                .arg("-c")
                .arg("umask 000; exec \"$0\" \"$@\"")
                .arg(bin)
                .args(&args)
                .output()
                .unwrap();
            assert!(o.status.success(), "{args:?}: {}", stderr(&o));
            let mode = std::fs::metadata(&out).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{name} (existing: {existing}): mode {mode:o}");
        }
    }
}

/// A packed file of `blocks` blocks of 65,536 identical samples (thread 0,
/// stack 0, one interval apart), each LZ4 payload a single literal run
/// (FORMAT.md, section 10): 125 bytes a block, 524 samples a byte.
fn repetitive_packed(blocks: u64) -> Vec<u8> {
    let t0 = START_US;
    let mut w = spulse::SpoolWriter::new(Vec::new(), spulse::Header { start_time_us: t0, interval_us: 1000 })
        .unwrap();
    w.define_thread(7, 7, "main").unwrap();
    let f = w.define_frame(spulse::Frame::Absolute { address: 0x1010, kernel: false }).unwrap();
    w.define_stack(None, f).unwrap();
    let defs = w.into_inner().unwrap();
    // A coded column of `c` copies of `base`: one dictionary entry, every
    // field 0 bits wide.
    let column = |base: u64, c: u32| {
        let mut v = base.to_le_bytes().to_vec();
        v.extend_from_slice(&1u32.to_le_bytes());
        v.extend_from_slice(&[0, 0, 0, 0]);
        v.extend_from_slice(&c.to_le_bytes());
        v.extend_from_slice(&0u32.to_le_bytes());
        v
    };
    let n = 1u32 << 16;
    // The second layout (definitions stored as they are), which readers still read.
    let mut f = spulse::PACKED_MAGIC_V2.to_vec();
    f.extend_from_slice(&(defs.len() as u64).to_le_bytes());
    f.extend_from_slice(&defs);
    f.extend_from_slice(&0u64.to_le_bytes());
    let mut index = Vec::new();
    for b in 0..blocks {
        let first = t0 + b * n as u64 * 1000;
        let mut raw = first.to_le_bytes().to_vec();
        raw.extend(column(1000, n - 1));
        raw.extend(column(0, n));
        raw.extend(column(0, n));
        // One literal run of 80 bytes: token 0xf0, then 80 - 15.
        let mut lz4 = vec![0xf0, raw.len() as u8 - 15];
        lz4.extend_from_slice(&raw);
        index.extend_from_slice(&(f.len() as u64).to_le_bytes());
        index.extend_from_slice(&first.to_le_bytes());
        index.extend_from_slice(&(first + (n as u64 - 1) * 1000).to_le_bytes());
        index.extend_from_slice(&n.to_le_bytes());
        index.extend_from_slice(&(lz4.len() as u32).to_le_bytes());
        for v in [raw.len() as u32, lz4.len() as u32, n] {
            f.extend_from_slice(&v.to_le_bytes());
        }
        f.extend_from_slice(&lz4);
    }
    let index_at = f.len() as u64;
    f.extend_from_slice(&index);
    for v in [index_at, blocks, blocks * n as u64] {
        f.extend_from_slice(&v.to_le_bytes());
    }
    f.extend_from_slice(&spulse::PACKED_MAGIC_V2);
    f
}

/// `export --format firefox` of a 17 KB packed file of 9.2 million identical
/// samples: the samples cost their bytes in the output, not a gigabyte of
/// per-sample overhead (1.48 GB peak before, 114 MB now), so the export
/// succeeds within 1 GB of address space; with too little, it is an error
/// saying so (it aborted, 134, leaving its temporary file), and no
/// temporary file or output is left.
#[test]
fn firefox_export_of_a_repetitive_packed_file_is_bounded_and_fails_cleanly() {
    let p = program();
    let spk = p.dir.path().join("rep.spk");
    std::fs::write(&spk, repetitive_packed(140)).unwrap();
    assert!(ok(&["info", s(&spk)]).contains("samples:         9175040"), "{}", ok(&["info", s(&spk)]));
    let bin = env!("CARGO_BIN_EXE_spulse");
    let run = |limit_kb: u64, out: &std::path::Path| {
        std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("ulimit -v {limit_kb}; exec \"$0\" \"$@\""))
            .arg(bin)
            .args(["export", s(&spk), "--format", "firefox", "-o", s(out)])
            .output()
            .unwrap()
    };
    let leftovers = || -> Vec<String> {
        std::fs::read_dir(p.dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.starts_with('.'))
            .collect()
    };
    for name in ["rep.json", "rep.jslb.gz"] {
        let out = p.dir.path().join(name);
        let o = run(1_000_000, &out);
        assert!(o.status.success(), "{name} within 1 GB: {:?} {}", o.status, stderr(&o));
        assert!(stderr(&o).contains("9175040 samples written"), "{}", stderr(&o));
        if name == "rep.json" {
            // (Parsing 119 MB of JSON here would take more memory than the export.)
            let json = std::fs::read(&out).unwrap();
            let table = br#""samples":{"length":9175040,"weightType":"samples","stack":[0,0,0,"#;
            assert!(json.windows(table.len()).any(|w| w == table), "no samples table of 9175040 samples");
            assert!(json.windows(14).any(|w| w == br#""timeDeltas":["#));
        }
        std::fs::remove_file(&out).unwrap();
        let o = run(200_000, &out);
        assert_eq!(o.status.code(), Some(1), "{name} within 200 MB: {:?} {}", o.status, stderr(&o));
        assert!(stderr(&o).contains("out of memory holding"), "{}", stderr(&o));
        assert!(!out.exists(), "{name}");
        assert!(leftovers().is_empty(), "{name}: {:?}", leftovers());
    }
}
