//! Helpers shared by the chain-verdict integration tests: the golden configs of
//! core/testdata, the verify options, and a probe that answers like healthy plugin binaries.
#![allow(dead_code)] // each test binary uses a different part

use std::collections::BTreeMap;

use meshgate_core::cni::{ChainVerdict, MemSource, ProbeOutcome, Runtime, VerifyOptions, verify};

pub fn golden(name: &str) -> Vec<u8> {
    let path = format!("{}/testdata/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// A golden file with one textual replacement, asserting the replacement happened.
pub fn golden_with(name: &str, from: &str, to: &str) -> Vec<u8> {
    let text = String::from_utf8(golden(name)).unwrap();
    assert!(text.contains(from), "{name} lacks {from:?}");
    text.replacen(from, to, 1).into_bytes()
}

pub fn opts(required: &[&str]) -> VerifyOptions {
    VerifyOptions {
        conf_dir: "/etc/cni/net.d".into(),
        runtime: Runtime::Containerd,
        required: required.iter().map(|s| s.to_string()).collect(),
        multus: Default::default(),
    }
}

pub fn crio(required: &[&str]) -> VerifyOptions {
    VerifyOptions {
        runtime: Runtime::Crio,
        ..opts(required)
    }
}

/// A config directory from (name, content) pairs.
pub fn dir(files: &[(&str, Vec<u8>)]) -> MemSource {
    files
        .iter()
        .fold(MemSource::new(), |s, (n, c)| s.file(n, c.clone()))
}

/// A probe that answers like a healthy binary supporting the usual versions, except for the
/// types given special outcomes.
pub struct Bins {
    pub special: BTreeMap<&'static str, ProbeOutcome>,
    pub calls: Vec<String>,
}

impl Bins {
    pub fn healthy() -> Self {
        Self {
            special: BTreeMap::new(),
            calls: Vec::new(),
        }
    }
    pub fn with(mut self, t: &'static str, o: ProbeOutcome) -> Self {
        self.special.insert(t, o);
        self
    }
    pub fn probe(&mut self, t: &str) -> ProbeOutcome {
        self.calls.push(t.to_string());
        self.special
            .get(t)
            .cloned()
            .unwrap_or_else(|| ProbeOutcome::Answered {
                path: format!("/opt/cni/bin/{t}"),
                supported: ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]
                    .map(String::from)
                    .to_vec(),
            })
    }
}

pub fn run_src(src: &mut MemSource, o: &VerifyOptions, bins: &mut Bins) -> ChainVerdict {
    verify(src, o, |t| bins.probe(t))
}

pub fn run(files: &[(&str, Vec<u8>)], o: &VerifyOptions, bins: &mut Bins) -> ChainVerdict {
    run_src(&mut dir(files), o, bins)
}

pub fn missing() -> ProbeOutcome {
    ProbeOutcome::Missing {
        searched: vec!["/opt/cni/bin".into()],
    }
}
