//! The node gate's flag, declared once for both binaries: the agent taints its own Node with
//! `--taint-effect`, the webhook taints new Nodes at registration with the same effect.
//!
//! In: the command line and environment. Out: a `meshgate_core::gate::TaintEffect`, parsed
//! from the names the API uses (the values come from `TaintEffect::ALL`, so a new effect is
//! added in core only).

use clap::builder::{PossibleValuesParser, TypedValueParser};
use meshgate_core::gate::TaintEffect;

/// The node gate's flags (see docs/operations.md and docs/webhook.md).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::Args)]
pub struct NodeGateArgs {
    /// Effect of the meshgate.io/cni-unverified taint: NoSchedule keeps new pods off the
    /// node; NoExecute also evicts running pods that do not tolerate it (use with care).
    #[arg(
        long,
        env = "MESHGATE_TAINT_EFFECT",
        default_value = "NoSchedule",
        value_parser = taint_effect_parser()
    )]
    pub taint_effect: TaintEffect,
}

/// Accepts exactly the effects core knows, as the API spells them, and lists them in `--help`.
fn taint_effect_parser() -> impl TypedValueParser<Value = TaintEffect> {
    PossibleValuesParser::new(TaintEffect::ALL.map(TaintEffect::as_str))
        .try_map(|s| s.parse::<TaintEffect>())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        gate: NodeGateArgs,
    }

    fn parse(args: &[&str]) -> Result<TaintEffect, clap::Error> {
        let argv = std::iter::once("bin").chain(args.iter().copied());
        Cli::try_parse_from(argv).map(|c| c.gate.taint_effect)
    }

    #[test]
    fn the_flag_takes_the_api_names_and_defaults_to_no_schedule() {
        assert_eq!(parse(&[]).ok(), Some(TaintEffect::NoSchedule));
        assert_eq!(
            parse(&["--taint-effect", "NoExecute"]).ok(),
            Some(TaintEffect::NoExecute)
        );
        assert_eq!(
            parse(&["--taint-effect=NoSchedule"]).ok(),
            Some(TaintEffect::NoSchedule)
        );
        for bad in ["PreferNoSchedule", "noexecute", ""] {
            assert!(parse(&["--taint-effect", bad]).is_err(), "{bad:?}");
        }
    }
}
