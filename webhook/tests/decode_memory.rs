//! The memory a review's decoding holds, measured by a counting allocator: for the bodies an
//! attacker would send (tiny JSON objects where admission reads nothing, in the object it
//! reads, label or annotation maps of the shortest entries, a Node's shortest taints, and taints
//! of the shortest keys, which the decoder keeps since the taint key is a setting), the decoded review holds at
//! most `WORST_CASE_EXPANSION` bytes per body byte, the figure the server's review memory
//! budget charges. The figures are printed (`--nocapture`), with kube's
//! `AdmissionReview<DynamicObject>` decoding of the same bodies beside them.
//!
//! One test in this binary, so no other test's allocations are counted.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use kube::core::DynamicObject;
use kube::core::admission::AdmissionReview;
use meshgate_webhook::decode::{WORST_CASE_EXPANSION, decode};

/// The system allocator, counting the bytes live and their peak.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded unchanged to the system allocator.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Peak bytes allocated above the starting point while `f` runs, with its result still held.
fn peak_of<T>(f: impl FnOnce() -> T) -> (usize, T) {
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let out = f();
    (PEAK.load(Ordering::Relaxed) - base, out)
}

/// A pod CREATE review whose `object` has `object_members` besides its type, and whose
/// `oldObject` is `old_object`.
fn review(object_members: &str, old_object: &str) -> Vec<u8> {
    format!(
        r#"{{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{{"uid":"u1","kind":{{"group":"","version":"v1","kind":"Pod"}},"resource":{{"group":"","version":"v1","resource":"pods"}},"name":"p","namespace":"ns","operation":"CREATE","userInfo":{{"username":"u"}},"object":{{"apiVersion":"v1","kind":"Pod",{object_members}}},"oldObject":{old_object},"dryRun":false}}}}"#
    )
    .into_bytes()
}

/// `n` tiny objects: `{},{},...`.
fn tiny_objects(n: usize) -> String {
    vec!["{}"; n].join(",")
}

/// `n` map entries with distinct short keys and the value `value`.
fn entries(n: usize, value: &str) -> String {
    const DIGITS: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
    (0..n)
        .map(|mut i| {
            let mut key = String::new();
            loop {
                key.push(DIGITS[i % DIGITS.len()] as char);
                i /= DIGITS.len();
                if i == 0 {
                    break;
                }
            }
            format!(r#""{key}":"{value}""#)
        })
        .collect::<Vec<_>>()
        .join(",")
}

#[test]
fn decoding_holds_at_most_the_budgeted_bytes_per_body_byte() {
    // About 1 MiB each (3 MiB is the body limit; the ratios do not depend on the size).
    let n = 340_000;
    let bodies = [
        (
            "tiny objects in an unread member",
            review(&format!(r#""spec":{{"x":[{}]}}"#, tiny_objects(n)), "{}"),
        ),
        (
            "tiny objects in metadata.managedFields",
            review(
                &format!(r#""metadata":{{"managedFields":[{}]}}"#, tiny_objects(n)),
                "null",
            ),
        ),
        (
            "tiny objects in oldObject",
            review(r#""spec":{}"#, &format!(r#"{{"x":[{}]}}"#, tiny_objects(n))),
        ),
        (
            "labels of empty values",
            review(
                &format!(r#""metadata":{{"labels":{{{}}}}}"#, entries(n / 3, "")),
                "null",
            ),
        ),
        (
            "Node taints of the shortest kind placement keeps",
            review(
                &format!(
                    r#""spec":{{"taints":[{}]}}"#,
                    vec![r#"{"effect":"NoSchedule"}"#; n / 8].join(",")
                ),
                "null",
            ),
        ),
        (
            "annotations of one-letter values",
            review(
                &format!(
                    r#""metadata":{{"annotations":{{{}}}}}"#,
                    entries(n / 3, "v")
                ),
                "null",
            ),
        ),
        (
            "taints of one-letter keys",
            review(
                &format!(
                    r#""spec":{{"taints":[{}]}}"#,
                    vec![r#"{"key":"k"}"#; n / 3].join(",")
                ),
                "null",
            ),
        ),
    ];
    let mut worst = 0.0f64;
    for (what, body) in &bodies {
        let len = body.len();
        let (kube, decoded) =
            peak_of(|| serde_json::from_slice::<AdmissionReview<DynamicObject>>(body).map(|_| ()));
        assert!(decoded.is_ok(), "{what}: kube refused it: {decoded:?}");
        let (ours, decoded) = peak_of(|| decode(body));
        let req = decoded.unwrap_or_else(|e| panic!("{what}: {e}"));
        drop(req);
        let ratio = ours as f64 / len as f64;
        worst = worst.max(ratio);
        eprintln!(
            "[decode_memory] {what}: body {len} B; kube's DynamicObject decoding {:.1} B/B, \
             meshgate's {ratio:.2} B/B",
            kube as f64 / len as f64
        );
        assert!(
            ours <= WORST_CASE_EXPANSION * len,
            "{what}: decoding held {ours} B for a {len} B body ({ratio:.1} B/B, budgeted {WORST_CASE_EXPANSION})"
        );
    }
    eprintln!("[decode_memory] worst: {worst:.2} B/B (budgeted {WORST_CASE_EXPANSION})");
}
