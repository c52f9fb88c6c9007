//! Running the test binary again as a child, also when it was cross-built and
//! runs under an emulator.
//!
//! Cargo runs a cross-built test through the runner named by
//! `CARGO_TARGET_<TRIPLE>_RUNNER` (for aarch64 on x86_64: `qemu-aarch64 -L
//! /usr/aarch64-linux-gnu`). Without binfmt_misc the kernel cannot exec a
//! foreign-architecture binary, so a test that re-executes itself must go
//! through the same runner. The variable is read from the environment, where
//! `.ci/aarch64` exports it.

use std::process::Command;

/// The runner command cargo uses for this target (program and its arguments),
/// if one is set in the environment.
pub fn runner() -> Option<Vec<String>> {
    let var = format!("CARGO_TARGET_{}_UNKNOWN_LINUX_GNU_RUNNER", std::env::consts::ARCH.to_uppercase());
    let v = std::env::var(var).ok()?;
    let words: Vec<String> = v.split_whitespace().map(str::to_string).collect();
    (!words.is_empty()).then_some(words)
}

/// Whether this test runs under an emulator (a runner is set for its target).
pub fn emulated() -> bool {
    runner().is_some()
}

/// A command that runs this test executable again, through the runner if set.
pub fn self_command() -> Command {
    let exe = std::env::current_exe().expect("path of the test executable");
    match runner() {
        Some(words) => {
            let mut c = Command::new(&words[0]);
            c.args(&words[1..]).arg(exe);
            c
        }
        None => Command::new(exe),
    }
}
