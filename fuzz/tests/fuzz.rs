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
    use meshgate_fuzz::runner::{crate_dir, load_dir, load_seeds};
    let dir = crate_dir().join("corpus");
    let conf = load_seeds("conflist").expect("conflist seeds");
    let parsed = conf
        .iter()
        .filter(|(_, b)| {
            meshgate_core::cni::NetConfList::from_conflist_bytes(b).is_ok()
                || meshgate_core::cni::NetConfList::from_conf_bytes(b).is_ok()
        })
        .count();
    assert!(
        parsed * 2 >= conf.len(),
        "{parsed} of {} conflist seeds parse",
        conf.len()
    );

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
    assert!(
        with_rules >= 2,
        "{with_rules} netlink seeds carry decodable rules"
    );

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
    assert!(
        decoded * 2 >= adm.len(),
        "{decoded} of {} reviews decode",
        adm.len()
    );
}

/// The captured netfilter seeds are what their names say: the real kernel's bytes for the
/// meshes' rules, which the agent's decoders turn into redirected verdicts.
#[test]
fn captured_netfilter_seeds_decode_to_the_meshes_redirects() {
    use meshgate_agent::netfilter::{legacy, nftables};
    use meshgate_core::profile::ProfileSet;
    use meshgate_core::rules::{Family, IpFamily, RedirectVerdict, Ruleset, check_pod};
    let dir = meshgate_fuzz::runner::crate_dir().join("corpus");
    let profiles = ProfileSet::all_builtin();
    let verdict = |rs: &Ruleset, profile: &str, fam: IpFamily| {
        let p = profiles.get(profile).expect("built-in profile");
        check_pod(rs, p, &[fam], &std::collections::BTreeMap::new()).verdict
    };
    let assembled = |file: &str| -> Ruleset {
        let bytes = std::fs::read(dir.join("netlink").join(file)).expect("seed");
        let (mut t, mut c, mut r) = (Vec::new(), Vec::new(), Vec::new());
        for m in nftables::decode_buffer(&bytes).expect("decodes") {
            match m.body {
                b @ nftables::Body::Table(_) => t.push(b),
                b @ nftables::Body::Chain(_) => c.push(b),
                b @ nftables::Body::Rule(_) => r.push(b),
                _ => {}
            }
        }
        nftables::assemble(t, c, r)
    };
    let rs = assembled("linkerd-iptables-nft-all.bin");
    assert_eq!(
        verdict(&rs, "linkerd", IpFamily::V4),
        RedirectVerdict::Redirected
    );
    assert_eq!(
        verdict(&rs, "linkerd", IpFamily::V6),
        RedirectVerdict::Redirected
    );
    assert_eq!(
        verdict(&rs, "istio", IpFamily::V4),
        RedirectVerdict::Missing
    );
    let rs = assembled("istio-nft-all.bin");
    assert_eq!(
        verdict(&rs, "istio", IpFamily::V4),
        RedirectVerdict::Redirected
    );
    assert_eq!(
        verdict(&rs, "linkerd", IpFamily::V4),
        RedirectVerdict::Missing
    );
    let rs = assembled("empty-all.bin");
    assert_eq!(
        verdict(&rs, "linkerd", IpFamily::V4),
        RedirectVerdict::Missing
    );

    for (file, fam, ip) in [
        ("linkerd-legacy-ip-nat.bin", Family::Ip, IpFamily::V4),
        ("linkerd-legacy-ip6-nat.bin", Family::Ip6, IpFamily::V6),
    ] {
        let b = std::fs::read(dir.join("getsockopt").join(file)).expect("seed");
        let info = legacy::decode_info(&b[2..]).expect("info");
        let blob = &b[2 + meshgate_fuzz::targets::GETINFO_LEN..];
        let table = legacy::decode_table(fam, "nat", &info, blob).expect("table");
        let rs = Ruleset {
            tables: vec![table],
        };
        assert_eq!(
            verdict(&rs, "linkerd", ip),
            RedirectVerdict::Redirected,
            "{file}"
        );
    }
}
