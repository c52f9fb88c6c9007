//! The recorder writes seed 001's stream header (magic, start time, requested
//! interval, nothing else) when it creates the spool, so a `Tail` opened the
//! moment `start` returns finds the complete header before the writer thread
//! has flushed anything.

mod recorder_support;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use recorder_support::*;

fn now_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_micros() as u64
}

fn uvar(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

#[test]
fn tail_opened_right_after_start_sees_the_complete_seed_header() {
    let _serial = serial();
    let (_dir, path) = spool_path("header.spool");
    let before = now_us();
    // The longest flush interval the builder accepts, far longer than the test: the writer thread never ticks
    // before `finish`, so whatever the file holds was written during `start`.
    let guard = spulse::Recorder::builder()
        .frequency_hz(500)
        .flush_interval(Duration::from_secs(600))
        .start(&path)
        .expect("start");
    let after = now_us();
    let tail = spulse::Tail::open(&path).expect("a Tail opened right after start reads the header");
    assert!(
        (before..=after).contains(&tail.start_time_us()),
        "start time {} outside the start call [{before}, {after}]",
        tail.start_time_us()
    );
    assert_eq!(tail.interval_us(), 2000);

    // Byte for byte: the magic, the two varints, then (if anything) a record tag.
    let bytes = std::fs::read(&path).unwrap();
    let mut header = b"SPULSE3\0".to_vec();
    uvar(tail.start_time_us(), &mut header);
    uvar(2000, &mut header);
    assert_eq!(&bytes[..header.len()], &header[..], "the header is exactly the seed's");
    assert_eq!(tail.position(), header.len() as u64);
    if let Some(&tag) = bytes.get(header.len()) {
        assert!((1..=8).contains(&tag), "byte {tag} after the interval is not a record tag");
    }
    let stats = guard.finish().expect("finish");
    // The engine is reported by the recorder, not stored in the spool.
    assert_ne!(stats.engine, spulse::Engine::Unknown);
    let snap = spulse::Snapshot::open(&path).unwrap();
    assert_eq!((snap.start_time_us(), snap.interval_us()), (tail.start_time_us(), 2000));
}
