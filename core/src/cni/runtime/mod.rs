//! The container runtimes whose config loading meshgate reproduces, one record each.
//!
//! In: a runtime's name (`--runtime`, JSON). Out: a [`Runtime`], a handle on that runtime's
//! [`RuntimeRules`]: how it treats a config file that fails to load, and whether plugin
//! binaries take part in choosing the file. [`super::select`] and [`super::verdict`] read
//! only these records, so a new runtime is one file here and one line in [`Runtime::ALL`].

mod containerd;
mod crio;

/// What a runtime does with a candidate config file that fails to load (or to validate).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OnInvalid {
    /// The first candidate decides: if it fails, nothing loads (go-cni `loadFromConfDir`
    /// with containerd's default `max_conf_num = 1`: no second file is ever read).
    Fatal,
    /// Failing candidates are skipped; the first one left is the default network (ocicni
    /// `loadNetworks`).
    Skip,
}

/// One container runtime's config-loading rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RuntimeRules {
    /// The name used in `--runtime` and JSON output.
    pub name: &'static str,
    /// The name used in messages (`CRI-O`).
    pub display: &'static str,
    /// One line for `--help`.
    pub summary: &'static str,
    /// What a candidate that fails to load does to selection.
    pub on_invalid: OnInvalid,
    /// True when every loaded list must also pass libcni's `ValidateNetworkList` (each chain
    /// plugin's binary exists and supports the list's cniVersion) to be chosen, as ocicni
    /// does; a list that fails it counts as failing to load.
    pub validates_chain: bool,
}

/// The container runtime whose loading semantics are applied: a handle on its
/// [`RuntimeRules`]. Serialized as its name.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Runtime(&'static RuntimeRules);

// The two spellings the flags, JSON and tests have always used for the built-in runtimes.
#[allow(non_upper_case_globals)]
impl Runtime {
    /// containerd (go-cni): the first file wins; an invalid first file is fatal.
    pub const Containerd: Runtime = Runtime(&containerd::RULES);
    /// CRI-O (ocicni): files that fail to load or validate are skipped.
    pub const Crio: Runtime = Runtime(&crio::RULES);
}

impl Runtime {
    /// Every runtime meshgate knows, in `--help` order.
    pub const ALL: [Runtime; 2] = [Runtime::Containerd, Runtime::Crio];

    /// The runtime's rules.
    pub fn rules(self) -> &'static RuntimeRules {
        self.0
    }

    /// The name used in flags and JSON output.
    pub fn as_str(self) -> &'static str {
        self.0.name
    }

    /// The runtime with this name, if meshgate knows it.
    pub fn named(name: &str) -> Option<Runtime> {
        Runtime::ALL.into_iter().find(|r| r.as_str() == name)
    }
}

impl Default for Runtime {
    fn default() -> Self {
        Runtime::Containerd
    }
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Runtime").field(&self.0.name).finish()
    }
}

impl std::fmt::Display for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0.name)
    }
}

impl serde::Serialize for Runtime {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.0.name)
    }
}

impl<'de> serde::Deserialize<'de> for Runtime {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        Runtime::named(&name).ok_or_else(|| {
            let known: Vec<&str> = Runtime::ALL.iter().map(|r| r.as_str()).collect();
            serde::de::Error::custom(format!(
                "unknown runtime {name:?} (known: {})",
                known.join(", ")
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_stay_as_the_flags_spell_them() {
        assert_eq!(Runtime::default(), Runtime::Containerd);
        for r in Runtime::ALL {
            assert_eq!(Runtime::named(r.as_str()), Some(r));
            let json = serde_json::to_string(&r).unwrap();
            assert_eq!(serde_json::from_str::<Runtime>(&json).unwrap(), r);
        }
        assert_eq!(serde_json::to_string(&Runtime::Crio).unwrap(), "\"crio\"");
        assert_eq!(Runtime::Containerd.as_str(), "containerd");
        assert!(Runtime::named("docker").is_none());
        assert!(serde_json::from_str::<Runtime>("\"docker\"").is_err());
    }
}
