use std::path::Path;

use super::*;

fn p(s: &str) -> Option<&Path> {
    Some(Path::new(s))
}

const CONF: &str = "/etc/cni/net.d/10-calico.conflist";
const TMP: &str = "/etc/cni/net.d/.10-calico.conflist.tmp";

#[test]
fn a_rename_into_place_is_settled_at_once() {
    // `mv` from elsewhere on the same filesystem: one MOVED_TO.
    assert!(settles([(p(CONF), Change::MovedIn)]));
    // Istio's and Linkerd's atomic write: the temporary file is written and closed, then
    // renamed over the config.
    assert!(settles([
        (p(TMP), Change::Created),
        (p(TMP), Change::Written),
        (p(TMP), Change::ClosedWrite),
        (p(TMP), Change::MovedOut),
        (p(CONF), Change::MovedIn),
    ]));
}

#[test]
fn an_in_place_write_waits_for_quiet_even_after_its_close() {
    // `echo ... > conflist`: the truncate and the write, then the close; a second round
    // (`>>`) may follow, so the close does not settle it.
    let mut b = Burst::new();
    b.note(p(CONF), Change::Written);
    assert!(!b.settled() && b.writing(), "truncated, not written yet");
    b.note(p(CONF), Change::Written);
    assert!(!b.settled() && b.writing(), "written, not closed");
    b.note(p(CONF), Change::ClosedWrite);
    assert!(!b.settled(), "closed, but it may be opened again");
    assert!(!b.writing(), "closed: quiet may end it now");
}

#[test]
fn a_new_file_waits_for_quiet_too() {
    let mut b = Burst::new();
    b.note(p(CONF), Change::Created);
    assert!(!b.settled() && b.writing(), "created by open(O_CREAT)");
    b.note(p(CONF), Change::ClosedWrite);
    assert!(!b.settled() && !b.writing());
}

#[test]
fn one_open_file_holds_the_burst_whatever_else_settles() {
    let other = "/opt/cni/bin/istio-cni";
    assert!(!settles([
        (p(CONF), Change::Written),
        (p(other), Change::MovedIn),
        (p(other), Change::Attrib),
    ]));
    // Closing another file does not close this one.
    let mut b = Burst::new();
    b.note(p(CONF), Change::Written);
    b.note(p(other), Change::ClosedWrite);
    assert!(b.writing());
}

#[test]
fn atomic_changes_are_settled() {
    for change in [
        Change::Removed,
        Change::Attrib,
        Change::CreatedComplete,
        Change::MovedOut,
        Change::ClosedWrite,
    ] {
        assert!(settles([(p(CONF), change)]), "{change:?}");
    }
}

#[test]
fn a_file_removed_while_written_no_longer_holds_the_burst() {
    assert!(settles([
        (p(TMP), Change::Written),
        (p(TMP), Change::Removed)
    ]));
}

#[test]
fn events_without_a_path_or_of_unknown_kind_wait_for_quiet() {
    assert!(!settles([(None, Change::MovedIn)]));
    assert!(!settles([(p(CONF), Change::Unknown)]));
    // A later close cannot undo not knowing.
    assert!(!settles([
        (None, Change::Unknown),
        (p(CONF), Change::ClosedWrite)
    ]));
}

#[test]
fn too_many_written_files_wait_for_quiet() {
    let names: Vec<String> = (0..=MAX_WRITTEN_TRACKED)
        .map(|i| format!("/etc/cni/net.d/{i}"))
        .collect();
    let mut b = Burst::new();
    for n in &names {
        b.note(Some(Path::new(n)), Change::Written);
    }
    for n in &names {
        b.note(Some(Path::new(n)), Change::MovedOut);
    }
    assert!(
        !b.settled(),
        "past the bound the burst is not tracked file by file"
    );
}
