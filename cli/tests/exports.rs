//! Every export format checked by a real consumer where one exists:
//! `go tool pprof` for pprof, the speedscope file-format JSON schema (through
//! Python's `jsonschema`) for speedscope, a structural walk of the Firefox
//! Profiler processed format, and inferno's SVG for flame graphs. Outside CI a
//! missing external oracle skips only its check, loudly (`common::oracle`).

mod common;

use std::collections::HashMap;
use std::process::Command;

use common::*;
use serde_json::Value;

/// Export `spool` in `format` to `name` in the program's directory; returns its path.
fn export(p: &Program, spool: &std::path::Path, format: &str, name: &str) -> std::path::PathBuf {
    let out = p.dir.path().join(name);
    ok(&["export", s(spool), "--format", format, "-o", s(&out)]);
    out
}

/// Parse `go tool pprof -top` rows into name -> (flat, cum).
fn pprof_top(file: &std::path::Path, tmp: &std::path::Path) -> HashMap<String, (f64, f64)> {
    let out = Command::new("go")
        .args(["tool", "pprof", "-top", "-symbolize=none", "-sample_index=samples", "-nodecount=100"])
        .arg(file)
        .env("PPROF_TMPDIR", tmp)
        .env("HOME", tmp)
        .output()
        .expect("go tool pprof (install Debian's golang-go)");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "go tool pprof failed: {}\n{text}", String::from_utf8_lossy(&out.stderr));
    let mut rows = HashMap::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        // flat flat% sum% cum cum% name...
        if f.len() >= 6 && f[1].ends_with('%') && f[4].ends_with('%') {
            if let (Ok(flat), Ok(cum)) = (f[0].parse::<f64>(), f[3].parse::<f64>()) {
                rows.insert(f[5..].join(" "), (flat, cum));
            }
        }
    }
    assert!(!rows.is_empty(), "no rows in go tool pprof output:\n{text}");
    rows
}

#[test]
fn pprof_is_read_by_go_tool_pprof() {
    if !have_go_pprof() {
        return;
    }
    let (p, spool) = fixture();
    let out = export(&p, &spool, "pprof", "a.pb.gz");
    let rows = pprof_top(&out, p.dir.path());
    assert_eq!(rows.get("hot_a"), Some(&(300.0, 300.0)), "{rows:?}");
    assert_eq!(rows.get("hot_b"), Some(&(100.0, 100.0)), "{rows:?}");
    assert_eq!(rows.get("main"), Some(&(0.0, 400.0)), "{rows:?}");
}

#[test]
fn pprof_carries_mappings_addresses_and_build_ids() {
    let (p, spool) = fixture();
    let out = export(&p, &spool, "pprof", "a.pb.gz");
    let prof = read_pprof(&out);
    let st = &prof.string_table;
    assert_eq!(prof.mapping.len(), 1);
    let m = &prof.mapping[0];
    let bid: String = p.build_id.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(st[m.build_id as usize], bid);
    assert_eq!(st[m.filename as usize], s(&p.path));
    assert_eq!(m.memory_start, BASE + p.text.2);
    assert_eq!(m.file_offset, p.text.0);
    assert!(m.has_functions && m.has_line_numbers);
    // Every location has an address inside its mapping, and the hot_a location
    // is at the recorded address.
    for l in &prof.location {
        assert_eq!(l.mapping_id, 1);
        assert!(l.address >= m.memory_start && l.address < m.memory_limit);
    }
    let want = BASE + p.text.2 + (p.hot_a - p.text.0);
    let fname = |l: &spulse_cli::export::pprof::Location| {
        let f = prof.function.iter().find(|f| f.id == l.line.last().unwrap().function_id).unwrap();
        st[f.name as usize].clone()
    };
    let loc = prof.location.iter().find(|l| l.address == want).expect("hot_a location");
    assert_eq!(fname(loc), "hot_a");
    assert!(loc.line[0].line > 0, "line numbers from DWARF");
    let total: i64 = prof.sample.iter().map(|s| s.value[0]).sum();
    assert_eq!(total, 400);
    // Samples carry thread labels: per tid, 300 (tid 1001) and 100 (tid 1002).
    let key = |k: &str| st.iter().position(|x| x == k).unwrap() as i64;
    let mut per_tid: HashMap<i64, i64> = HashMap::new();
    for smp in &prof.sample {
        let tid = smp.label.iter().find(|l| l.key == key("tid")).expect("tid label").num;
        let name = smp.label.iter().find(|l| l.key == key("thread")).expect("thread label").str;
        assert_eq!(st[name as usize], if tid == 1001 { "main" } else { "worker" });
        *per_tid.entry(tid).or_default() += smp.value[0];
    }
    assert_eq!(per_tid, HashMap::from([(1001, 300), (1002, 100)]));
    assert_eq!(prof.period, INTERVAL_US as i64 * 1000);
}

#[test]
fn pprof_without_symbols_can_be_resymbolized_by_go_tool_pprof() {
    if !have_go_pprof() {
        return;
    }
    // Exported with --no-symbolize, the profile holds only addresses, mappings
    // and build ids; go tool pprof symbolizes it from the binary itself.
    let (p, spool) = fixture();
    let out = p.dir.path().join("bare.pb.gz");
    ok(&["export", s(&spool), "--format", "pprof", "--no-symbolize", "-o", s(&out)]);
    let o = Command::new("go")
        .args(["tool", "pprof", "-top", "-sample_index=samples"])
        .arg(&out)
        .env("PPROF_TMPDIR", p.dir.path())
        .env("HOME", p.dir.path())
        .env("PPROF_BINARY_PATH", p.dir.path())
        .output()
        .expect("go tool pprof");
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let hot_a = text.lines().find(|l| l.contains("hot_a")).unwrap_or_else(|| panic!("hot_a not in\n{text}"));
    assert!(hot_a.trim_start().starts_with("300 "), "{hot_a}");
}

#[test]
fn svg_flame_graph_names_functions() {
    let (p, spool) = fixture();
    let out = export(&p, &spool, "svg", "a.svg");
    let svg = std::fs::read_to_string(&out).unwrap();
    assert!(svg.starts_with("<?xml") && svg.contains("<svg"), "not an SVG");
    assert!(svg.trim_end().ends_with("</svg>"));
    assert!(svg.contains("hot_a (300 samples, 75.00%)"), "hot_a frame with its count");
    assert!(svg.contains("hot_b (100 samples, 25.00%)"));
    assert!(svg.contains("<script"), "interactive");
}

/// Validate a speedscope export against speedscope's published schema.
fn validate_speedscope(out: &std::path::Path) {
    let schema = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/speedscope-file-format-schema.json");
    let script = "import json,sys,jsonschema\n\
                  schema=json.load(open(sys.argv[1])); doc=json.load(open(sys.argv[2]))\n\
                  jsonschema.validate(doc, schema)\nprint('valid')\n";
    let o = Command::new("python3")
        .args(["-c", script, schema])
        .arg(out)
        .output()
        .expect("python3 (with the jsonschema package)");
    assert!(
        o.status.success() && String::from_utf8_lossy(&o.stdout).contains("valid"),
        "speedscope export does not validate: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn speedscope_validates_against_published_schema() {
    let (p, spool) = fixture();
    let out = export(&p, &spool, "speedscope", "a.speedscope.json");
    if have_jsonschema() {
        validate_speedscope(&out);
    }
    // And it holds the split: per-thread profiles, weights in microseconds.
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let frames = v["shared"]["frames"].as_array().unwrap();
    let mut leaf: HashMap<String, u64> = HashMap::new();
    let profiles = v["profiles"].as_array().unwrap();
    assert_eq!(profiles.len(), 2, "one profile per thread");
    for prof in profiles {
        let samples = prof["samples"].as_array().unwrap();
        let weights = prof["weights"].as_array().unwrap();
        for (st, w) in samples.iter().zip(weights) {
            let last = st.as_array().unwrap().last().unwrap().as_u64().unwrap() as usize;
            let name = frames[last]["name"].as_str().unwrap().to_string();
            *leaf.entry(name).or_default() += w.as_u64().unwrap();
        }
        assert_eq!(
            prof["samples"][0][0],
            serde_json::json!(frames.iter().position(|f| f["name"] == "main").unwrap()),
            "root first"
        );
    }
    assert_eq!(leaf["hot_a"], 300 * INTERVAL_US);
    assert_eq!(leaf["hot_b"], 100 * INTERVAL_US);
}

/// Leaf function name -> sample count, walking the processed format's tables.
fn firefox_leaf_counts(v: &Value) -> HashMap<String, u64> {
    let mut out = HashMap::new();
    let shared_strings = v["shared"]["stringArray"].as_array();
    for th in v["threads"].as_array().unwrap() {
        let strings = th["stringArray"].as_array().or(shared_strings).expect("string table");
        let stacks = &th["stackTable"];
        let frames = &th["frameTable"];
        let funcs = &th["funcTable"];
        let samples = &th["samples"];
        let n = samples["length"].as_u64().unwrap() as usize;
        for i in 0..n {
            let st = samples["stack"][i].as_u64().unwrap() as usize;
            let fr = stacks["frame"][st].as_u64().unwrap() as usize;
            let fu = frames["func"][fr].as_u64().unwrap() as usize;
            let name = funcs["name"][fu].as_u64().unwrap() as usize;
            let w = samples["weight"].as_array().map(|w| w[i].as_u64().unwrap()).unwrap_or(1);
            *out.entry(strings[name].as_str().unwrap().to_string()).or_default() += w;
        }
    }
    out
}

#[test]
fn firefox_profile_parses_and_names_hot_functions() {
    let (p, spool) = fixture();
    let out = export(&p, &spool, "firefox", "a.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).expect("JSON");
    assert!(v["meta"]["preprocessedProfileVersion"].as_u64().is_some());
    assert_eq!(v["meta"]["symbolicated"], true);
    let threads = v["threads"].as_array().unwrap();
    assert_eq!(threads.len(), 2);
    let names: Vec<&str> = threads.iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert!(names.contains(&"main") && names.contains(&"worker"), "{names:?}");
    let libs = v["libs"].as_array().unwrap();
    assert_eq!(libs.len(), 1, "{libs:?}");
    assert_eq!(libs[0]["name"], "hotprog");
    let bid: String = p.build_id.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(libs[0]["codeId"], bid);
    let leaf = firefox_leaf_counts(&v);
    assert_eq!(leaf.get("hot_a"), Some(&300), "{leaf:?}");
    assert_eq!(leaf.get("hot_b"), Some(&100), "{leaf:?}");
}

#[test]
fn exports_honour_thread_filter() {
    let (p, spool) = fixture();
    let out = p.dir.path().join("t.folded");
    ok(&["export", s(&spool), "--format", "collapsed", "--thread", "1002", "-o", s(&out)]);
    assert_eq!(std::fs::read_to_string(&out).unwrap(), "main;hot_a 100\n");
}

/// main;hot_a x 6 and main;hot_b;[kernel] x 4 (system time spent in a call
/// made from hot_b, as the recorder writes it: a kernel-mode absolute leaf at
/// address 0), in `k.spool` in the program's directory.
fn kernel_fixture() -> (Program, std::path::PathBuf) {
    let p = program();
    let path = p.dir.path().join("k.spool");
    let mut w = spulse::SpoolWriter::new(std::fs::File::create(&path).unwrap(), header()).unwrap();
    let m = define_program(&mut w, &p, PID, p.path.as_os_str().as_encoded_bytes(), &p.build_id);
    let (s_a, s_b) = define_hot_stacks(&mut w, &p, m);
    let f_k = w.define_frame(spulse::Frame::Absolute { address: 0, kernel: true }).unwrap();
    let s_k = w.define_stack(Some(s_b), f_k).unwrap();
    let th = w.define_thread(PID, PID, "main").unwrap();
    let mut t = START_US;
    for i in 0..10 {
        t += INTERVAL_US;
        w.sample(t, th, if i % 5 < 3 { s_a } else { s_k }).unwrap();
    }
    w.into_inner().unwrap();
    (p, path)
}

#[test]
fn kernel_leaves_are_counted_in_every_view_and_export() {
    let (p, spool) = kernel_fixture();

    let rows: Value = serde_json::from_str(&ok(&["top", s(&spool), "--json", "-n", "0"])).unwrap();
    let row = |name: &str| rows.as_array().unwrap().iter().find(|r| r["function"] == name).cloned();
    let k = row("[kernel]").expect("a [kernel] row");
    assert_eq!((k["self"].as_u64(), k["total"].as_u64()), (Some(4), Some(4)), "{rows}");
    assert_eq!(k["module"], "[kernel]");
    let b = row("hot_b").unwrap();
    assert_eq!((b["self"].as_u64(), b["total"].as_u64()), (Some(0), Some(4)), "{rows}");
    assert_eq!(row("hot_a").unwrap()["self"].as_u64(), Some(6));

    let text = ok(&["top", s(&spool), "-n", "0"]);
    assert!(text.lines().any(|l| l.contains("[kernel]")), "{text}");
    let table = ok(&["follow", s(&spool), "--interval", "0.01", "-n", "0"]);
    assert!(table.lines().any(|l| l.contains("[kernel]") && l.trim_start().starts_with('4')), "{table}");

    let folded = export(&p, &spool, "collapsed", "k.folded");
    let mut lines: Vec<String> =
        std::fs::read_to_string(&folded).unwrap().lines().map(String::from).collect();
    lines.sort();
    assert_eq!(lines, ["main;hot_a 6", "main;hot_b;[kernel] 4"]);

    let ss = export(&p, &spool, "speedscope", "k.speedscope.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&ss).unwrap()).unwrap();
    let frames = v["shared"]["frames"].as_array().unwrap();
    let mut leaf: HashMap<String, u64> = HashMap::new();
    for prof in v["profiles"].as_array().unwrap() {
        for (st, w) in prof["samples"].as_array().unwrap().iter().zip(prof["weights"].as_array().unwrap()) {
            let last = st.as_array().unwrap().last().unwrap().as_u64().unwrap() as usize;
            *leaf.entry(frames[last]["name"].as_str().unwrap().to_string()).or_default() +=
                w.as_u64().unwrap();
        }
    }
    assert_eq!(leaf.get("[kernel]"), Some(&(4 * INTERVAL_US)), "{leaf:?}");

    let ff = export(&p, &spool, "firefox", "k.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&ff).unwrap()).unwrap();
    assert_eq!(firefox_leaf_counts(&v).get("[kernel]"), Some(&4));

    let svg = export(&p, &spool, "svg", "k.svg");
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(svg.contains("[kernel] (4 samples"), "no [kernel] box of 4 samples in the SVG");

    if have_go_pprof() {
        let pb = export(&p, &spool, "pprof", "k.pb.gz");
        let rows = pprof_top(&pb, p.dir.path());
        assert_eq!(rows.get("[kernel]"), Some(&(4.0, 4.0)), "{rows:?}");
    }

    let info = ok(&["info", s(&spool)]);
    assert!(info.contains("kernel time:     4 sample(s) (40.0%) in the kernel"), "{info}");
    let v: Value = serde_json::from_str(&ok(&["info", s(&spool), "--json"])).unwrap();
    assert_eq!(v["kernel_samples"], 4);
    // A spool without one says what that may mean.
    let (_p2, plain) = fixture();
    let info = ok(&["info", s(&plain)]);
    assert!(info.contains("kernel time:     no sample in the kernel: either"), "{info}");
}
