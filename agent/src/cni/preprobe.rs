//! Probes plugin binaries as they appear or change in the bin dirs, so the verification that
//! follows the conflist write finds their answers cached.
//!
//! In: paths from the inotify watch ([`PreProber::notice`]: created, closed after writing,
//! renamed into place, chmod'ed). Out: answers in the [`Prober`]'s cache, under the key the
//! binary has when it is probed, and `meshgate_preprobes_total`.
//!
//! Bounded: [`WORKERS`] threads, a queue of [`QUEUE`] names (a name already queued is not
//! queued again; past the bound it is dropped and counted: the verification probes it as
//! before), and each run is the prober's own (`--probe-timeout`, output caps, PID namespace,
//! one of its run slots). Only a path directly in a bin dir with a plain file name is taken,
//! and [`Prober::preprobe`] decides whether it may run at all.

use std::collections::HashSet;
use std::path::Path;
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};

use meshgate_core::cni::probe::is_plain_name;

use super::Prober;

/// Threads probing ahead (each run also needs one of the prober's run slots, so a
/// verification always finds one free).
pub const WORKERS: usize = 2;
/// Names waiting to be probed ahead.
pub const QUEUE: usize = 64;

/// The pre-probe queue and its workers; they end when it is dropped.
pub struct PreProber {
    prober: Arc<Prober>,
    tx: SyncSender<String>,
    /// Queued, not yet taken by a worker: a burst of events for one binary queues it once.
    queued: Arc<Mutex<HashSet<String>>>,
}

impl PreProber {
    /// Starts the workers for `prober`.
    pub fn start(prober: Arc<Prober>) -> std::io::Result<Self> {
        let (tx, rx) = sync_channel::<String>(QUEUE);
        let rx = Arc::new(Mutex::new(rx));
        let queued: Arc<Mutex<HashSet<String>>> = Arc::default();
        for _ in 0..WORKERS {
            let (prober, rx, queued) = (prober.clone(), rx.clone(), queued.clone());
            std::thread::Builder::new()
                .name("cni-preprobe".into())
                .spawn(move || work(&prober, &rx, &queued))?;
        }
        Ok(Self { prober, tx, queued })
    }

    /// Something happened to `path`: queues its name when it lies directly in a bin dir.
    /// Never blocks (it runs on the inotify thread).
    pub fn notice(&self, path: &Path) {
        let Some(dir) = path.parent() else { return };
        if !self.prober.bin_dirs().iter().any(|d| d == dir) {
            return;
        }
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            return;
        };
        if !is_plain_name(name) {
            return;
        }
        let mut queued = self.queued.lock().unwrap_or_else(|e| e.into_inner());
        if !queued.insert(name.to_string()) {
            return;
        }
        match self.tx.try_send(name.to_string()) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                queued.remove(name);
                self.prober.counters().preprobe("dropped");
            }
        }
    }
}

/// A worker: takes names until the queue's sender is gone. A name is un-queued before it is
/// probed, so a change during its probe queues it again (and a changed binary has a new key).
fn work(prober: &Prober, rx: &Mutex<Receiver<String>>, queued: &Mutex<HashSet<String>>) {
    loop {
        let next = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
        let Ok(name) = next else { return };
        queued
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&name);
        prober.preprobe(&name);
    }
}
