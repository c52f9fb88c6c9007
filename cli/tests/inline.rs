//! Inlined frames: an address inside code that `mix` was inlined into `hot_c`
//! counts for `hot_c` in `top` by default, for `mix` with `top --inlines`, and
//! shows as `main;hot_c;mix` in the stack-shaped exports. binutils'
//! `addr2line -i` is the oracle that picks such an address.

mod common;

use std::process::Command;

use common::*;
use object::{Object, ObjectSegment, ObjectSymbol};
use serde_json::Value;
use spulse::{Frame, Header, NewModule, SpoolWriter};

const SRC: &str = r#"
static inline __attribute__((always_inline)) double mix(double x, int i) {
    return x * 1.0000001 + (double)i / 3.0;
}
__attribute__((noinline)) double hot_c(int n) {
    double x = 1;
    for (int i = 0; i < n; i++) x = mix(x, i);
    return x;
}
int main(int argc, char **argv) { return (int)hot_c(argc * 1000); }
"#;

#[test]
fn inlined_functions_are_expanded() {
    // addr2line picks the address this test is about: without it there is no test.
    if !have_binutils("addr2line") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("inl.c");
    std::fs::write(&src, SRC).unwrap();
    let exe = dir.path().join("inlprog");
    let o = Command::new("cc").args(["-g", "-O2", "-o"]).arg(&exe).arg(&src).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let data = std::fs::read(&exe).unwrap();
    let obj = object::File::parse(&*data).unwrap();
    let build_id = obj.build_id().unwrap().unwrap().to_vec();
    let sym = |n: &str| obj.symbols().find(|s| s.name() == Ok(n)).map(|s| (s.address(), s.size())).unwrap();
    let (c, csize) = sym("hot_c");
    let (m, msize) = sym("main");
    // Ask binutils which addresses of hot_c are inside the inlined mix.
    let addrs: Vec<String> = (c..c + csize).map(|a| format!("{a:#x}")).collect();
    let o = Command::new("addr2line").args(["-f", "-i", "-a", "-e"]).arg(&exe).args(&addrs).output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    let mut inlined = None;
    for block in text.split("0x").skip(1) {
        let lines: Vec<&str> = block.lines().collect();
        let funcs: Vec<&str> = lines[1..].iter().step_by(2).copied().collect();
        if funcs.first() == Some(&"mix") && funcs.last() == Some(&"hot_c") {
            inlined = Some(u64::from_str_radix(lines[0].trim(), 16).unwrap());
            break;
        }
    }
    let inlined = inlined.unwrap_or_else(|| panic!("no inlined mix in hot_c per addr2line:\n{text}"));

    let seg = obj
        .segments()
        .map(|s| (s.file_range().0, s.file_range().1, s.address(), s.size()))
        .find(|&(_, fs, va, _)| c >= va && c < va + fs)
        .unwrap();
    let off = |va: u64| va - seg.2 + seg.0;
    let spool = dir.path().join("inl.spool");
    let header = Header { start_time_us: START_US, interval_us: INTERVAL_US };
    let mut w = SpoolWriter::new(std::fs::File::create(&spool).unwrap(), header).unwrap();
    let mp = exe.as_os_str().as_encoded_bytes().to_vec();
    let module = w
        .define_module(&NewModule {
            pid: PID,
            start: BASE + seg.2,
            size: seg.3,
            file_offset: seg.0,
            generation: 1,
            path: &mp,
            build_id: &build_id,
        })
        .unwrap();
    let f_main = w.define_frame(Frame::Module { module, file_relative: off(m + msize / 2) }).unwrap();
    let f_leaf = w.define_frame(Frame::Module { module, file_relative: off(inlined) }).unwrap();
    let s_main = w.define_stack(None, f_main).unwrap();
    let s_leaf = w.define_stack(Some(s_main), f_leaf).unwrap();
    let th = w.define_thread(PID, PID, "main").unwrap();
    for i in 0..7 {
        w.sample(START_US + (i + 1) * INTERVAL_US, th, s_leaf).unwrap();
    }
    w.into_inner().unwrap();

    // By default the inlined helper's samples are the self time of the
    // function it was inlined into.
    let rows: Value = serde_json::from_str(&ok(&["top", s(&spool), "--json"])).unwrap();
    let names: Vec<&str> = rows.as_array().unwrap().iter().map(|r| r["function"].as_str().unwrap()).collect();
    assert_eq!(names, ["hot_c", "main"], "{rows}");
    assert_eq!((rows[0]["self"].as_u64(), rows[0]["total"].as_u64()), (Some(7), Some(7)));

    let rows: Value = serde_json::from_str(&ok(&["top", s(&spool), "--json", "--inlines"])).unwrap();
    let get = |n: &str| rows.as_array().unwrap().iter().find(|r| r["function"] == n).cloned();
    let mix = get("mix").unwrap_or_else(|| panic!("mix not in {rows}"));
    let hot_c = get("hot_c").unwrap_or_else(|| panic!("hot_c not in {rows}"));
    assert_eq!((mix["self"].as_u64(), mix["total"].as_u64()), (Some(7), Some(7)));
    assert_eq!((hot_c["self"].as_u64(), hot_c["total"].as_u64()), (Some(0), Some(7)));

    let out = dir.path().join("inl.folded");
    ok(&["export", s(&spool), "--format", "collapsed", "-o", s(&out)]);
    assert_eq!(std::fs::read_to_string(&out).unwrap(), "main;hot_c;mix 7\n");

    // In pprof the location holds both functions, the inlined one first.
    let pb = dir.path().join("inl.pb.gz");
    ok(&["export", s(&spool), "--format", "pprof", "-o", s(&pb)]);
    let prof = read_pprof(&pb);
    let name = |fid: u64| {
        let f = prof.function.iter().find(|f| f.id == fid).unwrap();
        prof.string_table[f.name as usize].clone()
    };
    let want = BASE + seg.2 + (inlined - seg.2);
    let loc = prof.location.iter().find(|l| l.address == want).expect("leaf location");
    let names: Vec<String> = loc.line.iter().map(|l| name(l.function_id)).collect();
    assert_eq!(names, ["mix", "hot_c"]);
    assert!(prof.mapping[0].has_inline_frames);
}
