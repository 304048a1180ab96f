//! `cargo test -p meshgate-fuzz`: every fuzz target for a fixed budget (see the crate docs).
//!
//! In: the committed corpora and regressions, `MESHGATE_FUZZ_SECONDS` /
//! `MESHGATE_FUZZ_ITERATIONS` / `MESHGATE_FUZZ_SEED`. Out: pass, or a failure naming the
//! input that panicked or ran too long (saved under `fuzz/artifacts/`). Each target is its
//! own test, so the harness runs them in parallel and reports them separately.

use meshgate_fuzz::runner::run_committed;
use meshgate_fuzz::targets;

fn fuzz(target: meshgate_fuzz::runner::Target) {
    match run_committed(&target) {
        Ok(report) => {
            eprintln!("{report}");
            assert!(
                report.executed > 0,
                "the budget allowed no mutated input at all: {report}"
            );
        }
        Err(failure) => panic!("fuzz {}: {failure}", target.name),
    }
}

#[test]
fn conflist_parser_and_selection_never_panic() {
    fuzz(targets::conflist());
}

#[test]
fn nftables_netlink_decoder_never_panics() {
    fuzz(targets::netlink());
}

#[test]
fn legacy_getsockopt_decoder_never_panics() {
    fuzz(targets::getsockopt());
}

#[test]
fn admission_review_decoder_never_panics() {
    fuzz(targets::admission());
}

#[test]
fn profile_file_parser_never_panics() {
    fuzz(targets::profiles());
}

/// Every committed seed decodes the way its name says, so the corpora keep exercising the
/// deep paths (a corpus of inputs rejected at the first byte would fuzz nothing).
#[test]
fn seeds_reach_past_the_first_parse() {
    use meshgate_fuzz::runner::{crate_dir, load_dir};
    let dir = crate_dir().join("corpus");
    let conf = load_dir(&dir.join("conflist")).expect("conflist corpus");
    let parsed = conf
        .iter()
        .filter(|(_, b)| meshgate_core::cni::NetConfList::from_conf_bytes(b).is_ok())
        .count();
    assert!(parsed * 2 >= conf.len(), "{parsed} of {} conflist seeds parse", conf.len());

    let nl = load_dir(&dir.join("netlink")).expect("netlink corpus");
    let with_rules = nl
        .iter()
        .filter(|(_, b)| {
            meshgate_agent::netfilter::nftables::decode_buffer(b).is_ok_and(|m| {
                m.iter()
                    .any(|m| matches!(m.body, meshgate_agent::netfilter::nftables::Body::Rule(_)))
            })
        })
        .count();
    assert!(with_rules >= 2, "{with_rules} netlink seeds carry decodable rules");

    let gs = load_dir(&dir.join("getsockopt")).expect("getsockopt corpus");
    let tables = gs
        .iter()
        .filter(|(_, b)| {
            let fam = if b[0] % 2 == 0 {
                meshgate_core::rules::Family::Ip
            } else {
                meshgate_core::rules::Family::Ip6
            };
            let rest = &b[2..];
            meshgate_agent::netfilter::legacy::decode_info(rest).is_some_and(|info| {
                let blob = rest.get(targets::GETINFO_LEN..).unwrap_or_default();
                meshgate_agent::netfilter::legacy::decode_table(fam, "nat", &info, blob).is_ok()
            })
        })
        .count();
    assert!(tables >= 2, "{tables} getsockopt seeds decode to tables");

    let adm = load_dir(&dir.join("admission")).expect("admission corpus");
    let decoded = adm
        .iter()
        .filter(|(_, b)| meshgate_webhook::review::decode(b).is_ok())
        .count();
    assert!(decoded * 2 >= adm.len(), "{decoded} of {} reviews decode", adm.len());
}
