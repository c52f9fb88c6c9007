//! The Firefox export's samples, kept apart from `fxprof-processed-profile`'s
//! tables and from the JSON document, and their serialized samples tables.
//!
//! A profile counts samples (the default: every weight 1, `weightType`
//! `samples`) or time (`--off-cpu`, `--wall`: `weightType` `tracing-ms`, a
//! CPU sample weighing its sampling interval and an off-CPU interval its
//! duration, in milliseconds; an off-CPU interval's `threadCPUDelta` is 0).

use std::collections::HashMap;

use fxprof_processed_profile as fx;
use serde_json::Value;

use crate::CliError;

/// The samples of one thread of the profile, kept apart from
/// `fxprof-processed-profile`'s tables and from the JSON document: a sample
/// costs 12 bytes here (20 in a time mode), where the library's table and
/// the document's values cost about 36 and 128 (a perfectly repetitive
/// packed file of 9 KB holds 9 million samples: the document alone took a
/// gigabyte).
#[derive(Default)]
pub struct ThreadSamples {
    /// Each sample's stack: an index into the thread's stack table in the
    /// document ([`super::profile`] maps them; while building, an index into
    /// `handles`).
    pub stack: Vec<u32>,
    /// Each sample's time, nanoseconds since the profile's reference.
    pub time_ns: Vec<u64>,
    /// In a time mode, each sample's off-CPU duration in microseconds: 0 for
    /// a CPU sample (it weighs the sampling interval), the interval's
    /// duration (never 0) for an off-CPU interval. Empty when the profile
    /// counts samples.
    pub off_cpu_us: Vec<u64>,
    /// The samples in time order (indices), when they are not already.
    pub order: Option<Vec<u32>>,
    /// The stacks the samples use, in order of first use.
    pub(super) handles: Vec<fx::StackHandle>,
    pub(super) local: HashMap<fx::StackHandle, u32>,
}

/// The samples of every thread, in the order of the document's `threads`.
pub struct Samples {
    pub threads: Vec<ThreadSamples>,
    /// Every CPU sample's CPU delta (the sampling interval), microseconds.
    pub cpu_delta_us: u64,
    /// Whether weights are time (`--off-cpu`, `--wall`), not sample counts.
    pub time: bool,
}

/// The error for samples that do not fit in memory.
pub(crate) fn out_of_memory(n: usize) -> CliError {
    CliError::other(format!(
        "out of memory holding {n} samples for the Firefox profile; export fewer (--from/--to, --thread)"
    ))
}

/// Make room for one more element, failing cleanly where the allocator
/// cannot give it.
fn reserve_one<T>(v: &mut Vec<T>) -> Result<(), CliError> {
    if v.len() == v.capacity() {
        v.try_reserve(v.len().max(1024)).map_err(|_| out_of_memory(v.len()))?;
    }
    Ok(())
}

impl ThreadSamples {
    /// Add a sample: a CPU sample (`off_cpu_us` `None`), or an off-CPU
    /// interval of that many microseconds. `time` says whether the profile
    /// weighs by time (every sample of a thread must agree).
    pub(super) fn push(
        &mut self,
        stack: fx::StackHandle,
        time_ns: u64,
        time: bool,
        off_cpu_us: Option<u64>,
    ) -> Result<(), CliError> {
        let id = match self.local.get(&stack) {
            Some(&id) => id,
            None => {
                let id = self.handles.len() as u32;
                self.handles.push(stack);
                self.local.insert(stack, id);
                id
            }
        };
        if self.time_ns.last().is_some_and(|&t| t > time_ns) && self.order.is_none() {
            self.order = Some(Vec::new());
        }
        reserve_one(&mut self.stack)?;
        reserve_one(&mut self.time_ns)?;
        if time {
            reserve_one(&mut self.off_cpu_us)?;
            // An interval of 0 us (never exported) would read as a CPU sample.
            self.off_cpu_us.push(off_cpu_us.map_or(0, |d| d.max(1)));
        }
        self.stack.push(id);
        self.time_ns.push(time_ns);
        Ok(())
    }

    /// The samples' indices in time order (ties in stream order).
    pub fn in_order(&self) -> impl Iterator<Item = usize> + '_ {
        let n = self.stack.len();
        let (sorted, all) = match &self.order {
            Some(o) => (&o[..], 0..0),
            None => (&[][..], 0..n),
        };
        sorted.iter().map(|&i| i as usize).chain(all)
    }

    /// Each sample's time minus the previous one's (the first's minus 0),
    /// in time order, in milliseconds: the `timeDeltas` column.
    pub fn time_deltas_ms(&self) -> impl Iterator<Item = f64> + '_ {
        let mut prev = 0u64;
        self.in_order().map(move |i| {
            let t = self.time_ns[i];
            let d = t - prev;
            prev = t;
            d as f64 / 1_000_000.0
        })
    }

    /// In a time mode, each sample's weight in milliseconds, in time order:
    /// `interval_us` for a CPU sample, the duration for an off-CPU interval.
    /// The `weight` column of `tracing-ms` samples.
    pub fn weights_ms(&self, interval_us: u64) -> impl Iterator<Item = f64> + '_ {
        self.in_order().map(move |i| {
            let off = self.off_cpu_us.get(i).copied().unwrap_or(0);
            (if off == 0 { interval_us } else { off }) as f64 / 1000.0
        })
    }

    /// Each sample's CPU delta in microseconds, in time order: `interval_us`
    /// for a CPU sample, 0 for an off-CPU interval. The `threadCPUDelta` column.
    pub fn cpu_deltas_us(&self, interval_us: u64) -> impl Iterator<Item = u64> + '_ {
        self.in_order().map(move |i| match self.off_cpu_us.get(i) {
            Some(&off) if off > 0 => 0,
            _ => interval_us,
        })
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.stack.len()
    }

    /// Whether the thread has no samples.
    pub fn is_empty(&self) -> bool {
        self.stack.is_empty()
    }
}

/// A column written straight from an iterator.
pub(crate) struct Seq<F>(pub(crate) F);

impl<F: Fn() -> I, I: Iterator<Item = T>, T: serde::Serialize> serde::Serialize for Seq<F> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq((self.0)())
    }
}

/// A thread's samples table (format version [`super::PROFILE_VERSION`], as
/// `fxprof-processed-profile` writes it: every weight 1, every CPU delta
/// the interval, sorted by time; in a time mode, weights in milliseconds).
struct SamplesTable<'a>(&'a ThreadSamples, &'a Samples);

impl serde::Serialize for SamplesTable<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let (t, n, cpu) = (self.0, self.0.len(), self.1.cpu_delta_us);
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("length", &n)?;
        m.serialize_entry("weightType", if self.1.time { "tracing-ms" } else { "samples" })?;
        m.serialize_entry("stack", &Seq(|| t.in_order().map(|i| t.stack[i])))?;
        m.serialize_entry("timeDeltas", &Seq(|| t.time_deltas_ms()))?;
        if self.1.time {
            m.serialize_entry("weight", &Seq(|| t.weights_ms(cpu)))?;
        } else {
            m.serialize_entry("weight", &Seq(|| std::iter::repeat_n(1, n)))?;
        }
        m.serialize_entry("threadCPUDelta", &Seq(|| t.cpu_deltas_us(cpu)))?;
        m.end()
    }
}

/// The document with each thread's samples table written in.
pub(super) struct WithSamples<'a> {
    pub(super) doc: &'a Value,
    pub(super) samples: &'a Samples,
}

impl serde::Serialize for WithSamples<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        struct Thread<'a>(&'a Value, Option<&'a ThreadSamples>, &'a Samples);
        impl serde::Serialize for Thread<'_> {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                let (Some(obj), Some(samples)) = (self.0.as_object(), self.1) else {
                    return self.0.serialize(s);
                };
                let mut m = s.serialize_map(Some(obj.len()))?;
                for (k, v) in obj {
                    if k == "samples" {
                        m.serialize_entry(k, &SamplesTable(samples, self.2))?;
                    } else {
                        m.serialize_entry(k, v)?;
                    }
                }
                m.end()
            }
        }
        let Some(obj) = self.doc.as_object() else { return self.doc.serialize(s) };
        let mut m = s.serialize_map(Some(obj.len()))?;
        for (k, v) in obj {
            match (k.as_str(), v.as_array()) {
                ("threads", Some(threads)) => m.serialize_entry(
                    k,
                    &Seq(|| {
                        threads
                            .iter()
                            .enumerate()
                            .map(|(j, th)| Thread(th, self.samples.threads.get(j), self.samples))
                    }),
                )?,
                _ => m.serialize_entry(k, v)?,
            }
        }
        m.end()
    }
}
