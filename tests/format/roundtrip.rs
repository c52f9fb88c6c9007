//! Round trips of random valid record sequences through `SpoolWriter` and every
//! reader (`Snapshot`, `Replay`, `Tail`), compared with the generator's model.

use proptest::prelude::*;
use spulse::{Replay, Snapshot, Tail};
use spulse_testkit::spool::*;

fn op() -> impl Strategy<Value = Op> {
    (any::<u8>(), any::<u64>(), any::<u64>(), any::<u64>())
}

fn check(ops: Vec<Op>) {
    let (bytes, model) = build(ops);
    let snap = Snapshot::from_bytes(&bytes).unwrap();
    assert!(!snap.recovered_from_truncated_tail());
    assert_eq!(snap.valid_len(), bytes.len() as u64);
    assert_snapshot_matches(&snap, &model);

    let file = temp_file(&bytes);
    let replay = Replay::options().index_limit(4).open(file.path()).unwrap();
    assert!(!replay.recovered_from_truncated_tail());
    assert!(replay.index_len() <= 4);
    let replayed = replay.samples().collect::<Result<Vec<_>, _>>().unwrap();
    assert!(replayed.iter().copied().eq(snap.samples()));
    assert_eq!(replay.frames(), snap.frames());
    assert_eq!(replay.modules(), snap.modules());
    assert_eq!(replay.threads(), snap.threads());
    assert_eq!(replay.deactivations(), snap.deactivations());
    assert_eq!(replay.python_runtime_events(), snap.python_runtime_events());

    let mut tail = Tail::open(file.path()).unwrap();
    let mut tailed = Vec::new();
    tail_drain(&mut tail, &mut tailed).unwrap();
    assert!(tailed.iter().copied().eq(snap.samples()));
    assert_eq!(tail.position(), bytes.len() as u64);
    assert!(!tail.has_incomplete_record());
    assert_eq!(tail.frames(), snap.frames());
    assert_eq!(tail.deactivations(), snap.deactivations());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_valid_spools_round_trip(ops in prop::collection::vec(op(), 0..200)) {
        check(ops);
    }
}

#[test]
fn a_long_generated_spool_round_trips() {
    for seed in 1..4 {
        check(random_ops(seed, 20_000));
    }
}

#[test]
fn every_record_kind_is_generated() {
    let (bytes, m) = build(random_ops(7, 3_000));
    assert!(m.deactivations > 0 && m.python_events > 0 && m.modules.len() > 8);
    assert!(m.frames.iter().any(|f| matches!(f, spulse::Frame::Truncated)));
    assert!(m.frames.iter().any(|f| matches!(f, spulse::Frame::Module { .. })));
    assert!(m.frames.iter().any(|f| matches!(f, spulse::Frame::Absolute { kernel: true, .. })));
    assert!(m.samples.windows(2).any(|w| w[1].0 < w[0].0), "some negative deltas");
    // A module range re-defined after its retirement.
    let snap = Snapshot::from_bytes(&bytes).unwrap();
    let mods = snap.modules();
    assert!(mods
        .iter()
        .enumerate()
        .any(|(i, a)| mods[..i].iter().any(|b| b.pid == a.pid && b.start == a.start)));
    for t in &m.samples {
        assert!(snap.stack_depth(snap.stack_id(t.2).unwrap()) >= 1);
    }
}

#[test]
fn seeking_uses_the_index_and_returns_the_suffix() {
    let (bytes, _) = build(random_ops(11, 30_000));
    let snap = Snapshot::from_bytes(&bytes).unwrap();
    let file = temp_file(&bytes);
    let replay = Replay::options().index_limit(8).open(file.path()).unwrap();
    assert!(replay.index_len() <= 8);
    assert!(replay.index_stride() as usize * replay.index_len() >= snap.len() / 2);
    let (lo, hi) = snap.time_range().unwrap();
    for k in 0..=10u64 {
        let t = lo + (hi - lo) / 10 * k;
        let first = snap.sample_times().position(|x| x >= t).unwrap_or(snap.len());
        let got: Vec<_> = replay.samples_from(t).map(Result::unwrap).collect();
        assert_eq!(got.len(), snap.len() - first, "t={t}");
        assert!(got.iter().copied().eq((first..snap.len()).map(|i| snap.sample(i))));
    }
}

#[test]
fn replay_reports_a_file_changed_after_open() {
    let (bytes, _) = build(random_ops(13, 5_000));
    let n = Snapshot::from_bytes(&bytes).unwrap().len();
    // Overwritten with garbage: some samples, then an error, never a panic.
    let file = temp_file(&bytes);
    let replay = Replay::options().chunk_size(0).open(file.path()).unwrap();
    let mut garbage = bytes.clone();
    for b in &mut garbage[bytes.len() / 2..] {
        *b = 0xff;
    }
    std::fs::write(file.path(), &garbage).unwrap();
    let results: Vec<_> = replay.samples().collect();
    assert!(results.len() < n + 1);
    let e = results.last().unwrap().as_ref().unwrap_err();
    assert_eq!(e.format_kind(), Some(&spulse::FormatErrorKind::ChangedSinceOpen), "{e}");
    assert!(results[..results.len() - 1].iter().all(|r| r.is_ok()));
    // Truncated after open: reported too, wherever the cut falls.
    for cut in [bytes.len() / 3, bytes.len() - 1, 70_000.min(bytes.len() - 1)] {
        let file = temp_file(&bytes);
        let replay = Replay::open(file.path()).unwrap();
        file.as_file().set_len(cut as u64).unwrap();
        let results: Vec<_> = replay.samples().collect();
        let e = results.last().unwrap().as_ref().unwrap_err();
        assert_eq!(e.format_kind(), Some(&spulse::FormatErrorKind::ChangedSinceOpen), "cut {cut}: {e}");
        assert!(e.offset().unwrap() <= cut as u64, "cut {cut}: {e}");
    }
}

#[test]
fn replay_matches_snapshot_across_read_chunks() {
    // Definitions interleaved with samples, in a file several read chunks
    // long: the scan's direct path, its definition skipping and its batch
    // path all hand out exactly the Snapshot's samples, in order.
    let (bytes, _) = build(random_ops(17, 60_000));
    assert!(bytes.len() > 3 * 64 * 1024, "{} bytes", bytes.len());
    let snap = Snapshot::from_bytes(&bytes).unwrap();
    let file = temp_file(&bytes);
    let replay = Replay::options().chunk_size(0).open(file.path()).unwrap();
    let got: Vec<_> = replay.samples().map(Result::unwrap).collect();
    assert_eq!(got.len(), snap.len());
    assert!(got.iter().copied().eq((0..snap.len()).map(|i| snap.sample(i))));
}
