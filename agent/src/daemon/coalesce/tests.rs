use std::path::{Path, PathBuf};

use meshgate_core::cni::burst::Change;

use super::*;

const QUIET: Duration = Duration::from_millis(20);

fn ev(path: &str, change: Change) -> FsEvent {
    FsEvent {
        at: Instant::now(),
        path: Some(PathBuf::from(path)),
        change,
    }
}

#[tokio::test]
async fn an_incomplete_burst_ends_when_it_goes_quiet_and_reports_its_last_event() {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let first = ev("/c/a", Change::Written);
    let mut sent = Vec::new();
    for _ in 0..3 {
        let e = ev("/c/a", Change::Written);
        sent.push(e.at);
        tx.send(e).unwrap();
    }
    let last = coalesce(&mut rx, first, QUIET).await;
    assert_eq!(last, sent[2]);
}

/// A writer touching the directory every 5 ms forever: the burst is cut at its bound
/// (200 ms here) instead of keeping the loop from verifying while the writes go on.
#[tokio::test]
async fn a_burst_that_never_goes_quiet_is_cut_at_its_bound() {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let writer = tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(5)).await;
            if tx.send(ev("/c/a", Change::Written)).is_err() {
                break;
            }
        }
    });
    let ended = tokio::time::timeout(
        Duration::from_secs(5),
        coalesce(&mut rx, ev("/c/a", Change::Written), QUIET),
    )
    .await;
    assert!(
        ended.is_ok(),
        "the burst was never cut while the writes went on"
    );
    assert!(
        !writer.is_finished(),
        "the writer was still writing when it was cut"
    );
    writer.abort();
}

/// A rename into place needs no quiet time: the burst is over before the next event, which
/// is left for the next wake-up.
#[tokio::test]
async fn a_rename_into_place_ends_the_burst_at_once() {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let first = ev("/c/10-calico.conflist", Change::MovedIn);
    let at = first.at;
    let later = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(10)).await;
        tx.send(ev("/c/other", Change::MovedIn)).unwrap();
        tx
    });
    assert_eq!(coalesce(&mut rx, first, Duration::from_secs(30)).await, at);
    let _tx = later.await.unwrap();
    assert!(
        rx.recv().await.is_some(),
        "the later event wakes the loop again"
    );
}

/// An in-place write holds the burst past a quiet time while its file is open, and ends it
/// a quiet time after its close-write (a second round of writes may follow the close).
#[tokio::test]
async fn an_in_place_write_ends_a_quiet_time_after_its_close() {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let conf = "/c/10-calico.conflist";
    let writer = tokio::spawn(async move {
        // Longer than the quiet time: a pause in the middle of the write.
        tokio::time::sleep(QUIET * 3).await;
        tx.send(ev(conf, Change::Written)).unwrap();
        tokio::time::sleep(QUIET * 2).await;
        let close = ev(conf, Change::ClosedWrite);
        let at = close.at;
        tx.send(close).unwrap();
        (tx, at)
    });
    let last = coalesce(&mut rx, ev(conf, Change::Written), QUIET).await;
    let (_tx, closed) = writer.await.unwrap();
    assert_eq!(
        last, closed,
        "the pause while the file was open did not end it"
    );
    assert!(
        closed.elapsed() >= QUIET,
        "it waited a quiet time after the close"
    );
}

/// Real files under a real inotify watch: how long after the write the burst ends, for a
/// rename into place and for an in-place write (printed; no timed assertion).
#[tokio::test]
async fn how_long_each_kind_of_write_waits() {
    let tmp = tempfile::tempdir().unwrap();
    let conf = tmp.path().join("net.d");
    std::fs::create_dir(&conf).unwrap();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let notice: super::super::fswatch::Notice = std::sync::Arc::new(|_: &Path| {});
    let _w =
        super::super::fswatch::FsWatch::start(&conf, &[], tx, notice, Default::default()).unwrap();
    let target = conf.join("10-calico.conflist");
    let body = br#"{"cniVersion":"1.0.0","name":"k8s","plugins":[{"type":"calico"}]}"#;
    for (name, rename) in [("rename into place", true), ("in-place write", false)] {
        let mut took = Vec::new();
        for _ in 0..20 {
            let written = Instant::now();
            if rename {
                let staged = conf.join(".staged");
                std::fs::write(&staged, body).unwrap();
                std::fs::rename(&staged, &target).unwrap();
            } else {
                std::fs::write(&target, body).unwrap();
            }
            let first = rx.recv().await.unwrap();
            coalesce(&mut rx, first, QUIET).await;
            took.push(written.elapsed());
            // Whatever the burst left (a late event) is not the next write's.
            tokio::time::sleep(Duration::from_millis(50)).await;
            while rx.try_recv().is_ok() {}
        }
        took.sort();
        println!(
            "{name}: burst over after p50 {:?}, max {:?} (20 writes, --coalesce {QUIET:?})",
            took[took.len() / 2],
            took[took.len() - 1]
        );
    }
}
