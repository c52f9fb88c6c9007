//! A spool recorded on aarch64 read by this (host) build of the CLI: the
//! library's `quickstart` example, cross-built for aarch64, records under the
//! emulator; its executable is then moved out of the path the spool names into
//! a `.build-id` tree, so the CLI can only find the aarch64 ELF file by the
//! build id the recorder wrote. Both hot functions must be named in their 3:1
//! proportion, and the leaf `parse_records` must be unwound into its caller
//! `ingest` (on aarch64 the leaf's return address is only in the link register).
//!
//! `.ci/aarch64` builds the quickstart for aarch64 and runs this test with
//! `--ignored`, giving it `SPULSE_AARCH64_QUICKSTART` (the executable) and
//! `CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER` (the emulator command).
//! Run without them it fails and says what is missing.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;

use common::*;
use object::Object;
use serde_json::Value;

#[test]
#[ignore = "run by .ci/aarch64 (needs the cross-built aarch64 quickstart and qemu-aarch64)"]
fn aarch64_spool_symbolized_by_build_id() {
    let exe = std::env::var_os("SPULSE_AARCH64_QUICKSTART")
        .map(PathBuf::from)
        .expect("SPULSE_AARCH64_QUICKSTART must name the aarch64 quickstart executable (see .ci/aarch64)");
    let runner = std::env::var("CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER").expect(
        "CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER must give the emulator command (see .ci/aarch64)",
    );
    let runner: Vec<&str> = runner.split_whitespace().collect();
    let (emu, emu_args) = runner.split_first().expect("a non-empty runner command");

    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    let copy = bin.join("quickstart");
    std::fs::copy(&exe, &copy).unwrap_or_else(|e| panic!("copy {}: {e}", exe.display()));
    let data = std::fs::read(&copy).unwrap();
    let elf = object::File::parse(&*data).expect("the quickstart is an ELF file");
    assert_eq!(
        elf.architecture(),
        object::Architecture::Aarch64,
        "{} is not an aarch64 executable",
        exe.display()
    );
    let build_id = elf.build_id().unwrap().expect("the quickstart has a build id").to_vec();
    drop(elf);

    let spool = dir.path().join("a64.spool");
    let o = Command::new(emu).args(emu_args).arg(&copy).arg(&spool).output().expect("run the emulator");
    assert!(o.status.success(), "aarch64 quickstart failed: {}", stderr(&o));

    // Move the executable away: only the build id leads to it now.
    let hex: String = build_id.iter().map(|b| format!("{b:02x}")).collect();
    let debug = dir.path().join("debug");
    let by_id = debug.join(".build-id").join(&hex[..2]);
    std::fs::create_dir_all(&by_id).unwrap();
    std::fs::rename(&copy, by_id.join(format!("{}.debug", &hex[2..]))).unwrap();

    let info: Value = serde_json::from_str(&ok(&["info", s(&spool), "--json"])).unwrap();
    let samples = info["samples"].as_u64().unwrap();
    assert!(samples > 200, "{info}");
    // The three workers, and the main thread when a sample caught it starting them.
    assert!((3..=4).contains(&info["threads"].as_u64().unwrap()), "{info}");

    let top = |extra: &[&str]| -> HashMap<String, u64> {
        let mut args = vec!["top", s(&spool), "--json", "-n", "0"];
        args.extend_from_slice(extra);
        let rows: Value = serde_json::from_str(&ok(&args)).unwrap();
        rows.as_array()
            .unwrap()
            .iter()
            .map(|r| (r["function"].as_str().unwrap().to_string(), r["total"].as_u64().unwrap()))
            .collect()
    };
    // Without the debug directory the moved file is not found: nothing is named.
    let unnamed = top(&[]);
    assert!(!unnamed.contains_key("quickstart::parse_records"), "named without its file: {unnamed:?}");

    let debug_s = s(&debug);
    let rows = top(&["--symbols", debug_s]);
    let get = |name: &str| *rows.get(name).unwrap_or_else(|| panic!("{name} not in top: {rows:?}")) as f64;
    let (parse, compress) = (get("quickstart::parse_records"), get("quickstart::compress_block"));
    let share = parse / (parse + compress);
    // Natively about 0.78. Under qemu-user a signal is delivered when the
    // emulator leaves a chain of translated blocks, so which of the two
    // loops a sample lands in follows the code's layout: 0.72 at 612abf6
    // and 0.94 at 9c8ebc6, which only added a table the example never reads.
    // Both functions must hold samples, parse the larger share.
    assert!(compress > 0.0 && (0.55..0.99).contains(&share), "parse share {share:.3}: {parse} vs {compress}");
    assert!(parse + compress >= 0.9 * samples as f64, "the workers' time is in the hot functions");

    // Folded stacks (root first; inlined callees such as `black_box` follow
    // their function): the leaf's caller comes from the link register, and the
    // walk reaches the thread root (std's thread entry, below it only glibc's
    // thread start in the stripped libc).
    let folded = dir.path().join("a64.folded");
    ok(&["export", s(&spool), "--format", "collapsed", "--symbols", debug_s, "-o", s(&folded)]);
    let (mut leaf, mut complete) = (0u64, 0u64);
    for l in std::fs::read_to_string(&folded).unwrap().lines() {
        let (stack, n) = l.rsplit_once(' ').unwrap();
        let n: u64 = n.parse().unwrap();
        let frames: Vec<&str> = stack.split(';').collect();
        let Some(i) = frames.iter().position(|f| *f == "quickstart::parse_records") else { continue };
        leaf += n;
        let caller_ok = i >= 1 && frames[i - 1] == "quickstart::ingest";
        let root_ok = frames.iter().position(|f| f.ends_with("::thread_start")).is_some_and(|r| r <= 2);
        if caller_ok && root_ok {
            complete += n;
        }
    }
    assert!(leaf > 100, "{leaf} samples in parse_records");
    assert!(
        complete as f64 >= 0.95 * leaf as f64,
        "{complete} of {leaf} parse_records samples unwound to the root"
    );
}
