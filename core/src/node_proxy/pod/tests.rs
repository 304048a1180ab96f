use super::*;
use crate::meshes::istio_ambient::ztunnel;

fn rules(verdict: RedirectVerdict) -> Inspection {
    let profile = crate::meshes::builtin_named("istio-ambient").unwrap();
    let mut i = Inspection::unknown(&profile, "rules");
    i.verdict = verdict;
    i.message = "in-pod rules".into();
    i
}

fn ports(p: &[u16]) -> BTreeSet<u16> {
    p.iter().copied().collect()
}

/// Rules' verdict, what listens (or why it cannot be read), ready, the verdict wanted.
type Case<'a> = (
    RedirectVerdict,
    Result<&'a BTreeSet<u16>, &'a str>,
    bool,
    RedirectVerdict,
);

/// Every combination of the rules' verdict, what listens, and the node proxy's readiness.
#[test]
fn every_combination_of_rules_listeners_and_readiness() {
    use RedirectVerdict::{Missing, Redirected, Unknown};
    let all = ports(&[15001, 15006, 15008, 22]);
    let some = ports(&[15006]);
    let none = ports(&[]);
    let table: Vec<Case> = vec![
        (Redirected, Ok(&all), true, Redirected),
        (Redirected, Ok(&all), false, Redirected),
        (Redirected, Ok(&some), true, Missing),
        (Redirected, Ok(&some), false, Missing),
        (Redirected, Ok(&none), true, Missing),
        (Redirected, Ok(&none), false, Missing),
        (Redirected, Err("EPERM"), true, Unknown),
        (Redirected, Err("EPERM"), false, Unknown),
    ];
    let mut table = table;
    // The rules' own Missing and Unknown stand whatever listens.
    for v in [Missing, Unknown] {
        for l in [Ok(&all), Ok(&some), Ok(&none), Err("EPERM")] {
            for ready in [true, false] {
                table.push((v, l, ready, v));
            }
        }
    }
    for (rules_verdict, listening, ready, want) in table {
        let (got, hold) = judge(rules(rules_verdict), &ztunnel(), listening, ready);
        assert_eq!(
            got.verdict, want,
            "rules {rules_verdict:?}, listening {listening:?}, ready {ready}: {}",
            got.message
        );
        // Held (never evicted) exactly when listeners are what is missing and the proxy is
        // not ready.
        let listeners_missing =
            rules_verdict == Redirected && matches!(listening, Ok(l) if l != &all);
        assert_eq!(
            hold,
            listeners_missing && !ready,
            "{rules_verdict:?} {listening:?} {ready}"
        );
    }
}

#[test]
fn the_message_names_the_ports_that_do_not_listen() {
    let some = ports(&[15006]);
    let got = judge(
        rules(RedirectVerdict::Redirected),
        &ztunnel(),
        Ok(&some),
        true,
    )
    .0;
    assert_eq!(
        got.message,
        "ztunnel has not taken this pod: no listener on 15008, 15001 in its netns"
    );
    let got = judge(
        rules(RedirectVerdict::Redirected),
        &ztunnel(),
        Ok(&some),
        false,
    )
    .0;
    assert_eq!(
        got.message,
        "ztunnel has not taken this pod: no listener on 15008, 15001 in its netns; \
         not evicted while ztunnel is not ready on this node"
    );
    let got = judge(
        rules(RedirectVerdict::Redirected),
        &ztunnel(),
        Err("EPERM"),
        true,
    )
    .0;
    assert!(
        got.message.ends_with("cannot be read: EPERM"),
        "{}",
        got.message
    );
}

#[test]
fn a_proxy_without_listen_ports_leaves_the_rules_verdict() {
    let mut proxy = ztunnel();
    proxy.listen_ports.clear();
    let none = ports(&[]);
    let (got, _) = judge(rules(RedirectVerdict::Redirected), &proxy, Ok(&none), true);
    assert_eq!(got.verdict, RedirectVerdict::Redirected);
    assert_eq!(got.message, "in-pod rules");
}
