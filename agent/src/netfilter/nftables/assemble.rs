//! The three dumps (tables, chains, rules) → a [`Ruleset`].
//!
//! In: the decoded [`Body`]s of each dump, rules in chain order. Out: the ruleset: dormant
//! tables and non-IP families left out, a base chain's `policy drop` as its last rule, and
//! each table labelled iptables-nft or native nft.

use std::collections::HashMap;

use meshgate_core::rules::{
    Action, BaseChain, Chain, ChainType, Family, Hook, Rule, Ruleset, Source, Table,
};

use super::{Body, RawChain, RawRule, RawTable, nf_family};

/// `NFT_TABLE_F_DORMANT`: the table's base chains are not attached to their hooks.
pub(super) const TABLE_F_DORMANT: u32 = 1;

fn hook(n: u32) -> Hook {
    match n {
        0 => Hook::Prerouting,
        1 => Hook::Input,
        2 => Hook::Forward,
        3 => Hook::Output,
        4 => Hook::Postrouting,
        _ => Hook::Other,
    }
}

fn chain_type(t: Option<&str>) -> ChainType {
    match t {
        Some("nat") => ChainType::Nat,
        Some("route") => ChainType::Route,
        _ => ChainType::Filter,
    }
}

/// Table names and base chain names iptables-nft uses: with xt expressions, how a table
/// is recognised as written by iptables-nft rather than by hand.
const IPTABLES_TABLES: &[&str] = &["nat", "filter", "mangle", "raw", "security"];
const IPTABLES_CHAINS: &[&str] = &["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"];

/// One table while its chains and rules come in.
struct Building {
    table: Table,
    uses_xt: bool,
    index: HashMap<String, usize>,
    /// Base chains with `policy drop`.
    drops: Vec<usize>,
}

/// Tables by (NFPROTO family, name), and the order they were dumped in.
#[derive(Default)]
struct Tables {
    order: Vec<(u32, String)>,
    building: HashMap<(u32, String), Building>,
}

/// Builds tables from the three dumps. Rules arrive in chain order.
pub fn assemble(tables: Vec<Body>, chains: Vec<Body>, rules: Vec<Body>) -> Ruleset {
    let mut t = Tables::default();
    for b in tables {
        if let Body::Table(raw) = b {
            t.add_table(raw);
        }
    }
    for b in chains {
        if let Body::Chain(c) = b {
            t.add_chain(c);
        }
    }
    for b in rules {
        if let Body::Rule(r) = b {
            t.add_rule(r);
        }
    }
    let mut out = Ruleset::default();
    for key in t.order {
        if let Some(b) = t.building.remove(&key) {
            out.tables.push(finish(b));
        }
    }
    out
}

impl Tables {
    /// A table of an IP family that is not dormant, the first time its name is seen.
    fn add_table(&mut self, t: RawTable) {
        let Some(family) = nf_family(t.family) else {
            return;
        };
        if t.flags & TABLE_F_DORMANT != 0 {
            return;
        }
        let key = (t.family, t.name.clone());
        if self.building.contains_key(&key) {
            return;
        }
        self.order.push(key.clone());
        let table = Table {
            family,
            name: t.name,
            source: Source::Nftables,
            chains: Vec::new(),
        };
        self.building.insert(
            key,
            Building {
                table,
                uses_xt: false,
                index: HashMap::new(),
                drops: Vec::new(),
            },
        );
    }

    /// A chain of a known table, the first time its name is seen in it.
    fn add_chain(&mut self, c: RawChain) {
        let Some(t) = self.building.get_mut(&(c.family, c.table.clone())) else {
            return;
        };
        if t.index.contains_key(&c.name) {
            return;
        }
        let base = c.hook.map(|h| BaseChain {
            hook: hook(h),
            chain_type: chain_type(c.chain_type.as_deref()),
            priority: c.priority,
        });
        if base.is_some() && c.policy == Some(libc::NF_DROP as u32) {
            t.drops.push(t.table.chains.len());
        }
        t.index.insert(c.name.clone(), t.table.chains.len());
        t.table.chains.push(Chain {
            name: c.name,
            base,
            rules: Vec::new(),
        });
    }

    /// A rule of a known chain, appended in dump order.
    fn add_rule(&mut self, r: RawRule) {
        let Some(t) = self.building.get_mut(&(r.family, r.table.clone())) else {
            return;
        };
        let Some(&i) = t.index.get(&r.chain) else {
            return;
        };
        t.uses_xt |= r.uses_xt;
        if let Some(chain) = t.table.chains.get_mut(i) {
            chain.rules.push(r.rule);
        }
    }
}

/// The finished table: `policy drop` as a last rule, and labelled by who wrote it.
fn finish(mut b: Building) -> Table {
    // A base chain's policy is the verdict of every packet that reaches its end: the same as
    // a last rule, which is how legacy tables hold it (the underflow entry).
    for &i in &b.drops {
        if let Some(c) = b.table.chains.get_mut(i) {
            c.rules.push(Rule::all(Action::Drop));
        }
    }
    let iptables_shape = matches!(b.table.family, Family::Ip | Family::Ip6)
        && IPTABLES_TABLES.contains(&b.table.name.as_str())
        && b.table
            .chains
            .iter()
            .filter(|c| c.base.is_some())
            .all(|c| IPTABLES_CHAINS.contains(&c.name.as_str()));
    if b.uses_xt || iptables_shape {
        b.table.source = Source::IptablesNft;
    }
    b.table
}
