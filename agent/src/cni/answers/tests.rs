use std::sync::Arc;
use std::time::Duration;

use super::*;

fn answer(path: &str) -> ProbeOutcome {
    ProbeOutcome::Answered {
        path: path.into(),
        supported: vec!["1.0.0".into()],
    }
}

fn key_of(path: &Path) -> Key {
    Key::now(path).unwrap()
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

/// A binary's key, shared answers, and the first caller's ticket to run it (the tempdir
/// must outlive the test).
fn first_run(dir: &Path) -> (Key, Arc<Answers>) {
    let bin = dir.join("istio-cni");
    std::fs::write(&bin, b"#!/bin/sh\n").unwrap();
    (key_of(&bin), Arc::new(Answers::default()))
}

/// Another caller of `key`, on its own thread.
fn waiter<T: Send + 'static>(
    answers: &Arc<Answers>,
    key: &Key,
    judge: fn(Claim<'_>) -> T,
) -> std::thread::JoinHandle<T> {
    let (answers, key) = (answers.clone(), key.clone());
    std::thread::spawn(move || judge(answers.claim(&key, soon())))
}

/// A second caller for a key in flight waits and takes its answer: the binary runs once.
#[test]
fn a_key_in_flight_is_waited_for_not_run_twice() {
    let dir = tempfile::tempdir().unwrap();
    let (key, answers) = first_run(dir.path());
    let Claim::Run(ticket) = answers.claim(&key, soon()) else {
        panic!("the first caller runs it");
    };
    let waiter = waiter(&answers, &key, |c| match c {
        Claim::Cached { outcome, waited } => Some((outcome, waited)),
        Claim::Run(_) | Claim::Expired => None,
    });
    std::thread::sleep(Duration::from_millis(50));
    assert!(!waiter.is_finished(), "the waiter must not run it too");
    ticket.finish(Some(answer("first")));
    // Whether it saw the flight (`waited`) depends on when its thread began; what it must
    // never get is a ticket of its own.
    let got = waiter.join().unwrap().map(|(outcome, _)| outcome);
    assert_eq!(got, Some(answer("first")));
    assert_eq!(answers.cached(), 1);
}

/// A run whose answer may not be kept (a timeout) leaves the key to the waiter, who runs it.
#[test]
fn a_waiter_runs_the_key_when_the_flight_kept_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (key, answers) = first_run(dir.path());
    let Claim::Run(ticket) = answers.claim(&key, soon()) else {
        panic!("first");
    };
    let waiter = waiter(&answers, &key, |c| matches!(c, Claim::Run(_)));
    std::thread::sleep(Duration::from_millis(20));
    ticket.finish(None);
    assert!(waiter.join().unwrap());
}

/// A binary rewritten after its probe has another key: its old answer is not used, and the
/// new one replaces it.
#[test]
fn a_changed_binary_is_probed_again() {
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("p");
    std::fs::write(&bin, b"one").unwrap();
    let old = key_of(&bin);
    let answers = Answers::default();
    let Claim::Run(t) = answers.claim(&old, soon()) else {
        panic!("first");
    };
    t.finish(Some(answer("old")));
    // Replaced by a rename (a new inode), then rewritten in place with the same length.
    let tmp = dir.path().join("tmp");
    std::fs::write(&tmp, b"two").unwrap();
    std::fs::rename(&tmp, &bin).unwrap();
    let replaced = key_of(&bin);
    assert_ne!(old, replaced);
    assert!(matches!(answers.claim(&replaced, soon()), Claim::Run(_)));
    std::thread::sleep(Duration::from_millis(10));
    std::fs::write(&bin, b"six").unwrap();
    let rewritten = key_of(&bin);
    assert_ne!(replaced, rewritten, "same size, new mtime/ctime");
    let Claim::Run(t) = answers.claim(&rewritten, soon()) else {
        panic!("a rewrite is a miss");
    };
    t.finish(Some(answer("new")));
    assert_eq!(answers.cached(), 1, "the old answer was dropped");
    assert!(matches!(answers.claim(&old, soon()), Claim::Run(_)));
}

/// No more than MAX_RUNS binaries run at once; a caller past that waits up to its deadline.
#[test]
fn runs_are_bounded_and_waiting_ends_at_the_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let keys: Vec<Key> = (0..=MAX_RUNS)
        .map(|i| {
            let bin = dir.path().join(format!("p{i}"));
            std::fs::write(&bin, b"x").unwrap();
            key_of(&bin)
        })
        .collect();
    let answers = Answers::default();
    let tickets: Vec<_> = keys[..MAX_RUNS]
        .iter()
        .map(|k| match answers.claim(k, soon()) {
            Claim::Run(t) => t,
            _ => panic!("a free slot"),
        })
        .collect();
    let short = Instant::now() + Duration::from_millis(30);
    assert!(matches!(
        answers.claim(&keys[MAX_RUNS], short),
        Claim::Expired
    ));
    drop(tickets);
    assert!(matches!(
        answers.claim(&keys[MAX_RUNS], soon()),
        Claim::Run(_)
    ));
}
