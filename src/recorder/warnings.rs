//! The live warning channel: what did not go as configured, handed to the
//! program as the writer thread finds it ([`Guard::warnings`](super::Guard::warnings),
//! [`RecorderBuilder::on_warning`](super::RecorderBuilder::on_warning)), not
//! only in [`Stats::warnings`](super::Stats::warnings) at the end.
//!
//! The writer thread keeps the one list of warnings (`WriterState::warnings`,
//! which becomes `Stats::warnings`); after each of its steps it publishes the
//! ones not yet published ([`Publisher::publish`]): each is appended to a
//! list shared with the [`Guard`](super::Guard) (a mutex held only to push a
//! string or to clone the list) and passed to the program's callback. So
//! every warning is published once, in the order of `Stats::warnings`, and
//! nothing here runs in the signal handler.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

/// The program's callback for warnings ([`RecorderBuilder::on_warning`](super::RecorderBuilder::on_warning)).
#[derive(Clone)]
pub(crate) struct WarningCallback(pub(crate) Arc<dyn Fn(&str) + Send + Sync + 'static>);

impl std::fmt::Debug for WarningCallback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WarningCallback(..)")
    }
}

/// The warnings published so far, shared by the writer thread and the guard.
#[derive(Debug, Default)]
pub(crate) struct WarningLog {
    list: Mutex<Vec<String>>,
}

impl WarningLog {
    /// A copy of the warnings published so far.
    pub(crate) fn snapshot(&self) -> Vec<String> {
        self.list.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn push(&self, w: String) {
        self.list.lock().unwrap_or_else(|e| e.into_inner()).push(w);
    }
}

/// The writer thread's side: what it has published, and to whom.
pub(crate) struct Publisher {
    log: Arc<WarningLog>,
    callback: Option<WarningCallback>,
    published: usize,
}

impl Publisher {
    pub(crate) fn new(log: Arc<WarningLog>, callback: Option<WarningCallback>) -> Publisher {
        Publisher { log, callback, published: 0 }
    }

    /// Publish `warnings[published..]`: into the shared log, then to the
    /// callback. A callback that panics is not called again, and a warning
    /// (published to the log, and in `warnings`) says so.
    pub(crate) fn publish(&mut self, warnings: &mut Vec<String>) {
        while self.published < warnings.len() {
            let w = warnings[self.published].clone();
            self.published += 1;
            self.log.push(w.clone());
            let Some(cb) = &self.callback else { continue };
            let f = &cb.0;
            if catch_unwind(AssertUnwindSafe(|| f(&w))).is_err() {
                self.callback = None;
                warnings.push(
                    "the on_warning callback panicked; it was not called again (the warnings stay in \
                     Guard::warnings and Stats::warnings)"
                        .to_string(),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_warning_is_published_once_in_order_and_a_panicking_callback_is_dropped() {
        let log = Arc::new(WarningLog::default());
        let seen = Arc::new(Mutex::new(Vec::<String>::new()));
        let s = seen.clone();
        let cb = WarningCallback(Arc::new(move |w: &str| {
            s.lock().unwrap().push(w.to_string());
            if w == "boom" {
                panic!("callback failure (expected by the test)");
            }
        }));
        let mut p = Publisher::new(log.clone(), Some(cb));
        let mut ws = vec!["a".to_string()];
        p.publish(&mut ws);
        p.publish(&mut ws);
        ws.push("b".into());
        ws.push("boom".into());
        p.publish(&mut ws);
        ws.push("c".into());
        p.publish(&mut ws);
        assert_eq!(*seen.lock().unwrap(), ["a", "b", "boom"]);
        assert_eq!(ws.len(), 5);
        assert!(ws[3].contains("panicked"), "{ws:?}");
        assert_eq!(ws[4], "c");
        assert_eq!(log.snapshot(), ws);
    }
}
