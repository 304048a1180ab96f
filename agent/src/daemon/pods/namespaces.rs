//! The labels of the node's pods' namespaces, as far as the profiles read them.
//!
//! In: the metadata-only Namespace watch's events (only when a profile selects on namespace
//! labels, `istio-ambient`). Out: each namespace's labels, only the keys the profiles read
//! ([`Namespaces::labels`]), whether the first list is complete, and which namespaces'
//! labels changed ([`Change`]), for the tracker to select their pods again.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use k8s_openapi::api::core::v1::Namespace;
use kube::api::PartialObjectMeta;
use kube::runtime::watcher;

/// A Namespace event, as the watch delivers it.
pub type NamespaceEvent = Result<watcher::Event<PartialObjectMeta<Namespace>>, watcher::Error>;

/// One namespace's labels changed (`labels: None`: it is gone).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Change {
    /// The namespace.
    pub name: String,
    /// Its labels now, the profiles' keys only.
    pub labels: Option<BTreeMap<String, String>>,
    /// Whether its labels were known before this change.
    pub known_before: bool,
}

/// What the inspector knows of the namespaces.
#[derive(Debug, Default)]
pub struct Namespaces {
    /// Namespace name → its labels, only the keys the profiles read.
    labels: HashMap<String, BTreeMap<String, String>>,
    /// The watch's (re)list in progress.
    relist: Option<HashMap<String, BTreeMap<String, String>>>,
    /// The label keys the profiles read; empty: no namespace watch.
    keys: BTreeSet<String>,
    /// True once the watch listed (or when there is none).
    synced: bool,
}

impl Namespaces {
    /// A view keeping `keys` of each namespace's labels; with no keys, nothing is watched and
    /// every namespace reads as unlabelled.
    pub fn new(keys: BTreeSet<String>) -> Self {
        Self {
            synced: keys.is_empty(),
            keys,
            ..Self::default()
        }
    }

    /// True when a namespace watch is needed.
    pub fn watched(&self) -> bool {
        !self.keys.is_empty()
    }

    /// True once the first list is complete: pods are selected only then, so no pod is
    /// selected without its namespace's labels at hand.
    pub fn synced(&self) -> bool {
        self.synced
    }

    /// How many namespaces are known.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// True when no namespace is known.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// The labels of `namespace` the profiles read: `None` when the watch has not delivered
    /// it, or an empty map when no profile reads namespace labels.
    pub fn labels(&self, namespace: &str) -> Option<&BTreeMap<String, String>> {
        static NONE: BTreeMap<String, String> = BTreeMap::new();
        if self.keys.is_empty() {
            return Some(&NONE);
        }
        self.labels.get(namespace)
    }

    fn slim(
        &self,
        ns: &PartialObjectMeta<Namespace>,
    ) -> Option<(String, BTreeMap<String, String>)> {
        let name = ns.metadata.name.clone()?;
        let labels = ns
            .metadata
            .labels
            .iter()
            .flatten()
            .filter(|(k, _)| self.keys.contains(*k))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        Some((name, labels))
    }

    /// Records a namespace's labels (`None`: gone); the change, if they changed.
    fn set(&mut self, name: &str, labels: Option<BTreeMap<String, String>>) -> Option<Change> {
        let same = self.labels.get(name) == labels.as_ref();
        let known_before = self.labels.contains_key(name);
        match &labels {
            Some(l) => self.labels.insert(name.to_owned(), l.clone()),
            None => self.labels.remove(name),
        };
        (!same).then(|| Change {
            name: name.to_owned(),
            labels,
            known_before,
        })
    }

    /// Applies one watch event; returns the namespaces whose labels changed.
    pub fn apply(&mut self, item: NamespaceEvent) -> Result<Vec<Change>, watcher::Error> {
        let changes = match item? {
            watcher::Event::Init => {
                self.relist = Some(HashMap::new());
                Vec::new()
            }
            watcher::Event::InitApply(ns) => {
                if let Some((name, labels)) = self.slim(&ns)
                    && let Some(relist) = self.relist.as_mut()
                {
                    relist.insert(name, labels);
                }
                Vec::new()
            }
            watcher::Event::InitDone => self.finish_list(),
            watcher::Event::Apply(ns) => self
                .slim(&ns)
                .and_then(|(name, labels)| self.set(&name, Some(labels)))
                .into_iter()
                .collect(),
            watcher::Event::Delete(ns) => ns
                .metadata
                .name
                .as_deref()
                .and_then(|name| self.set(name, None))
                .into_iter()
                .collect(),
        };
        Ok(changes)
    }

    /// The (re)list is complete: namespaces it did not list are gone.
    fn finish_list(&mut self) -> Vec<Change> {
        let listed = self.relist.take().unwrap_or_default();
        let gone: Vec<String> = self
            .labels
            .keys()
            .filter(|n| !listed.contains_key(*n))
            .cloned()
            .collect();
        let mut changes: Vec<Change> = gone.iter().filter_map(|n| self.set(n, None)).collect();
        changes.extend(
            listed
                .into_iter()
                .filter_map(|(n, l)| self.set(&n, Some(l))),
        );
        self.synced = true;
        changes
    }
}
