//! Size of the encoding on a profile-shaped spool (the generator of
//! `benches/spool.rs`): steady-state sample records take at most 6 bytes, and
//! the spool is several times smaller than the same data as JSON.

use spulse_testkit::profile as spool_profile;

#[test]
fn steady_state_samples_take_at_most_six_bytes() {
    let n = 300_000;
    let (bytes, g) = spool_profile::spool(n);
    let per_sample = g.sample_bytes as f64 / n as f64;
    let overall = bytes.len() as f64 / n as f64;
    println!("{per_sample:.3} bytes per sample record, {overall:.3} per sample overall");
    assert!(per_sample <= 6.0, "{per_sample}");
    let snap = spulse::Snapshot::from_bytes(&bytes).unwrap();
    assert_eq!(snap.len() as u64, n);
    // Shape: a few thousand leaf stacks of depth 10-60, several threads, some negative deltas.
    let mut leaves: Vec<_> = snap.samples().map(|s| s.stack).collect();
    leaves.sort();
    leaves.dedup();
    assert!(leaves.len() > 1_000, "{} distinct stacks", leaves.len());
    assert!(leaves.iter().all(|&s| (10..=60).contains(&snap.stack_depth(s))));
    assert_eq!(snap.threads().len(), spool_profile::THREADS);
    let times: Vec<u64> = snap.sample_times().collect();
    assert!(times.windows(2).any(|w| w[1] < w[0]));
    let json = spool_profile::to_json(&snap);
    assert!(json.len() > 3 * bytes.len(), "JSON {} vs spool {}", json.len(), bytes.len());
}
