//! meshgate's mode: how hard the gate acts on its verdicts, one live setting shared by the
//! agent and the webhook (docs/operations.md, "Modes").
//!
//! In: the text of the `mode` key of the ConfigMap `meshgate-mode` in meshgate's namespace
//! (or nothing, when the ConfigMap or the key is absent). Out: a [`Mode`], and per mode the
//! decisions the two binaries carry out: what the agent may do to meshgate's taint
//! ([`TaintPolicy`]), whether it may evict, what the webhook does with a placement
//! `core::admission` refuses ([`OnRefusal`]), and whether a Node gets the taint at CREATE.
//!
//! | mode | agent: condition, label, Events | agent: taint | agent: evict | webhook: refusal | taint at Node CREATE |
//! |---|---|---|---|---|---|
//! | `enforce` | yes | adds and removes it | yes | refuses | yes |
//! | `report` | yes ("would taint") | removes it, never adds it | no ("would evict") | admits with a warning and an audit annotation | no |
//! | `condition-only` | yes | never touches any taint | yes | refuses | no |
//!
//! Why `report` removes meshgate's taint: an operator who switches from `enforce` to `report`
//! wants meshgate to stop gating. A taint left behind would keep gating the node for ever,
//! since nothing in report mode would ever lift it. The taint is meshgate's own key, so
//! lifting it changes nothing another controller owns, unless the operator also runs a
//! NodeReadinessRule on the same key; that setup belongs with `condition-only` (with the
//! rule's own `dryRun` for a report-only look).
//!
//! Why `condition-only` touches no taint at all: the node-readiness-controller's
//! NodeReadinessRule owns the taint there, possibly under meshgate's very key, and two
//! writers of one taint fight. A taint meshgate left while it was enforcing stays too: the
//! rule lifts it once `MeshCNIVerified` is `True` when its key is the same (the shipped
//! example's is), and otherwise the operator removes it (docs/operations.md says how).
//!
//! An unreadable value is not guessed at: [`Mode::from_config`] says it is invalid, and the
//! caller falls back to [`Mode::FAIL_CLOSED`] (`enforce`), so a typo can never open the gate.

use std::fmt;
use std::str::FromStr;

/// Name of the ConfigMap, in meshgate's own namespace, that holds the mode.
pub const CONFIGMAP: &str = "meshgate-mode";
/// The ConfigMap's key whose value is the mode.
pub const KEY: &str = "mode";

/// How hard meshgate acts on its verdicts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Taint, evict, refuse: the gate.
    #[default]
    Enforce,
    /// Watch only: the condition, label, Events and metrics say what enforce would do.
    Report,
    /// Publish `MeshCNIVerified` (and evict, and refuse), and leave every taint to the
    /// node-readiness-controller.
    ConditionOnly,
}

/// What the agent may do to meshgate's taint on its Node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaintPolicy {
    /// Add it while the chain is not verified, remove it once it is.
    Manage,
    /// Remove it if present; never add it.
    RemoveOnly,
    /// Never add, change or remove any taint.
    Leave,
}

/// What the webhook does with a placement `core::admission` refuses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnRefusal {
    /// Refuse it (403, the message shown to the client).
    Refuse,
    /// Admit it, with the message as a warning to the client and an audit annotation.
    Warn,
}

impl Mode {
    /// Every mode, in the order the docs list them.
    pub const ALL: [Mode; 3] = [Mode::Enforce, Mode::Report, Mode::ConditionOnly];

    /// The mode an invalid setting falls back to: the gate stays closed.
    pub const FAIL_CLOSED: Mode = Mode::Enforce;

    /// The mode as the ConfigMap spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Enforce => "enforce",
            Mode::Report => "report",
            Mode::ConditionOnly => "condition-only",
        }
    }

    /// The mode the ConfigMap's `mode` value says; `None` (no ConfigMap, or no key) is
    /// [`Mode::Enforce`]. Surrounding whitespace is ignored (`--from-file` keeps a newline).
    pub fn from_config(value: Option<&str>) -> Result<Mode, UnknownMode> {
        value.map_or(Ok(Mode::Enforce), str::parse)
    }

    /// What the agent may do to meshgate's taint.
    pub fn taints(self) -> TaintPolicy {
        match self {
            Mode::Enforce => TaintPolicy::Manage,
            Mode::Report => TaintPolicy::RemoveOnly,
            Mode::ConditionOnly => TaintPolicy::Leave,
        }
    }

    /// Whether the agent may call the Eviction API for a pod without redirects.
    pub fn may_evict(self) -> bool {
        match self {
            Mode::Enforce | Mode::ConditionOnly => true,
            Mode::Report => false,
        }
    }

    /// What the webhook does with a placement admission refuses.
    pub fn on_refusal(self) -> OnRefusal {
        match self {
            Mode::Enforce | Mode::ConditionOnly => OnRefusal::Refuse,
            Mode::Report => OnRefusal::Warn,
        }
    }

    /// Whether the webhook taints a Node at CREATE (it labels it unverified in every mode).
    pub fn taints_at_registration(self) -> bool {
        self.taints() == TaintPolicy::Manage
    }

    /// Whether meshgate only reports what it would do.
    pub fn is_report(self) -> bool {
        self == Mode::Report
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A mode meshgate does not know (a typo, another tool's word for it).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown mode {0:?}: use enforce, report or condition-only")]
pub struct UnknownMode(pub String);

impl FromStr for Mode {
    type Err = UnknownMode;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        Self::ALL
            .into_iter()
            .find(|m| m.as_str() == t)
            .ok_or_else(|| UnknownMode(shorten(s)))
    }
}

/// Whatever was written, cut to a length a log line and an error can carry.
fn shorten(s: &str) -> String {
    const MAX: usize = 64;
    match s.char_indices().nth(MAX) {
        Some((end, _)) => format!("{}…", &s[..end]),
        None => s.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_modes_parse_from_their_names_and_nothing_else() {
        for m in Mode::ALL {
            assert_eq!(m.as_str().parse::<Mode>(), Ok(m));
            assert_eq!(m.to_string(), m.as_str());
        }
        assert_eq!(" report\n".parse::<Mode>(), Ok(Mode::Report));
        for bad in ["", "Enforce", "audit", "dry-run", "condition_only", "warn"] {
            let err = bad.parse::<Mode>().unwrap_err();
            assert!(
                err.to_string()
                    .contains("use enforce, report or condition-only"),
                "{err}"
            );
        }
        let long = "x".repeat(10_000);
        let err = long.parse::<Mode>().unwrap_err();
        assert!(
            err.0.chars().count() <= 65,
            "the error quotes a bounded excerpt"
        );
    }

    #[test]
    fn no_setting_is_enforce_and_an_unknown_one_is_an_error_that_falls_back_closed() {
        assert_eq!(Mode::from_config(None), Ok(Mode::Enforce));
        assert_eq!(Mode::default(), Mode::Enforce);
        assert_eq!(Mode::from_config(Some("report")), Ok(Mode::Report));
        assert!(Mode::from_config(Some("reprot")).is_err());
        assert_eq!(Mode::FAIL_CLOSED, Mode::Enforce);
    }

    /// The table of the module's documentation, row by row.
    #[test]
    fn each_mode_decides_as_documented() {
        let row = |m: Mode| {
            (
                m.taints(),
                m.may_evict(),
                m.on_refusal(),
                m.taints_at_registration(),
            )
        };
        assert_eq!(
            row(Mode::Enforce),
            (TaintPolicy::Manage, true, OnRefusal::Refuse, true)
        );
        assert_eq!(
            row(Mode::Report),
            (TaintPolicy::RemoveOnly, false, OnRefusal::Warn, false)
        );
        assert_eq!(
            row(Mode::ConditionOnly),
            (TaintPolicy::Leave, true, OnRefusal::Refuse, false)
        );
        assert!(Mode::Report.is_report());
        assert!(!Mode::ConditionOnly.is_report());
    }
}
