//! `--fs-watch=auto` without inotify: the agent's watch falls back to polling and still sees
//! a change.
//!
//! inotify is made unavailable the way a crowded host makes it so, without touching the
//! host's `fs.inotify` sysctls: `inotify_init1` fails with EMFILE when the process cannot
//! open another file descriptor, so this process's own file limit is lowered to its lowest
//! free descriptor number while the watch starts. Its own test binary (one test), so nothing
//! else in the process runs under that limit.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use meshgate_agent::daemon::fswatch::{FsWatch, Options};
use meshgate_core::cni::burst::Change;
use meshgate_core::cni::watch_backend::Mode;
use tokio::sync::mpsc;

/// The lowest free descriptor number: a file limit of it leaves no room for another.
fn lowest_free_fd() -> u64 {
    // SAFETY: dup returns a new descriptor this function closes at once.
    let fd = unsafe { libc::dup(0) };
    assert!(fd >= 0);
    unsafe { libc::close(fd) };
    fd as u64
}

#[test]
fn without_an_inotify_instance_auto_polls_and_sees_a_change() {
    let tmp = tempfile::tempdir().unwrap();
    let conf = tmp.path().join("net.d");
    std::fs::create_dir(&conf).unwrap();
    let file = conf.join("10-calico.conflist");
    std::fs::write(&file, b"{}").unwrap();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let options = Options {
        mode: Mode::Auto,
        poll_interval: Duration::from_millis(100),
        ..Options::default()
    };

    let was = nofile();
    set_nofile(lowest_free_fd(), was.rlim_max);
    assert_eq!(
        inotify_init_errno(),
        Some(libc::EMFILE),
        "no inotify instance can be had"
    );
    let started = FsWatch::start(&conf, &[], tx, Arc::new(|_: &Path| {}), options.clone());
    set_nofile(was.rlim_cur, was.rlim_max);

    let w = started.expect("the watch starts without inotify");
    assert!(w.polling(), "it polls instead");
    assert_eq!(options.polling.get(), 1, "and the gauge says so");
    // The first scan ran without room to open the directory: whatever it finds now counts as
    // a change, so drain until quiet, then change the config.
    std::thread::sleep(Duration::from_millis(300));
    while rx.try_recv().is_ok() {}
    std::fs::write(&file, b"{\"cniVersion\":\"1.0.0\"}").unwrap();
    let mut seen = None;
    for _ in 0..100 {
        if let Ok(e) = rx.try_recv() {
            seen = Some(e);
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let e = seen.expect("the rewrite is seen within a second");
    assert_eq!(e.change, Change::Unknown);
    assert_eq!(e.path.as_deref(), Some(file.as_path()));
}

/// The errno of `inotify_init1` now, `None` if it succeeded (the instance is closed again).
fn inotify_init_errno() -> Option<i32> {
    // SAFETY: plain syscalls on a descriptor this function owns.
    let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC) };
    if fd >= 0 {
        unsafe { libc::close(fd) };
        return None;
    }
    std::io::Error::last_os_error().raw_os_error()
}

fn nofile() -> libc::rlimit {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct it is given.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) }, 0);
    l
}

fn set_nofile(cur: u64, max: u64) {
    let l = libc::rlimit {
        rlim_cur: cur,
        rlim_max: max,
    };
    // SAFETY: setrlimit reads the struct it is given.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &l) }, 0);
}
