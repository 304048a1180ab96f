//! The Node cache: per Node, its name and its `meshgate.io/cni-verified` label, nothing else.
//!
//! In: the events of a metadata-only Node watch ([`NodeVerdicts::apply`]). Out: the label per
//! Node name ([`NodeVerdicts::labels`]), whether a name is known, the count, and a readiness
//! wait that ends once the first list is in.
//!
//! Why not a reflector store of the watched objects: a `Store<PartialObjectMeta<Node>>`
//! keeps, per Node, a whole `ObjectMeta` (about 400 bytes of struct even when slimmed), an
//! `Arc`, the label map's B-tree node and a key that copies the name, uid and
//! resourceVersion: 2.7 KB of resident memory per Node as measured (24.5 MiB at 5,000 Nodes,
//! 11.3 MiB with none), about 190 MiB at 65,000. Here an entry is the name, packed with the
//! others in one buffer ([`table::NameTable`]: why not one allocation per name), and the
//! label's value, with `true` and `false` held without an allocation.
//!
//! Lists replace the cache whole: a relist's objects are gathered apart and swapped in when it
//! is done, so lookups never see a half-listed cluster (as the reflector did).

mod table;

use std::collections::BTreeMap;
use std::sync::RwLock;

use k8s_openapi::api::core::v1::Node;
use kube::api::PartialObjectMeta;
use kube::runtime::watcher::Event;
use meshgate_core::gate::VERIFIED_LABEL;
use tokio::sync::watch;

/// A Node's `meshgate.io/cni-verified` label.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Verified {
    /// The Node does not carry the label.
    Absent,
    /// `true`: the agent verified the node.
    True,
    /// `false`: the agent has not verified it.
    False,
    /// Any other value, kept as is: the decision, not the cache, judges it.
    Other(Box<str>),
}

impl Verified {
    fn of(node: &PartialObjectMeta<Node>) -> Self {
        match node
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(VERIFIED_LABEL))
            .map(String::as_str)
        {
            None => Self::Absent,
            Some("true") => Self::True,
            Some("false") => Self::False,
            Some(other) => Self::Other(other.into()),
        }
    }

    fn value(&self) -> Option<&str> {
        match self {
            Self::Absent => None,
            Self::True => Some("true"),
            Self::False => Some("false"),
            Self::Other(v) => Some(v),
        }
    }
}

type Entries = table::NameTable<Verified>;

#[derive(Default)]
struct Lists {
    /// What lookups answer from.
    live: Entries,
    /// A list in progress, swapped into `live` when it is done.
    listing: Option<Entries>,
}

/// Puts Node `n` into `entries`; a Node without a name (never served) or with a name past
/// the table's bounds is left out, and a lookup then answers it as unknown.
fn insert(entries: &mut Entries, n: &PartialObjectMeta<Node>) {
    if let Some(name) = n.metadata.name.as_deref()
        && !entries.insert(name, Verified::of(n))
    {
        tracing::error!(node = name, "node name past the cache's bounds; not cached");
    }
}

/// The verified label of every Node, by name.
pub struct NodeVerdicts {
    lists: RwLock<Lists>,
    listed: watch::Sender<bool>,
}

impl Default for NodeVerdicts {
    fn default() -> Self {
        Self {
            lists: RwLock::default(),
            listed: watch::Sender::new(false),
        }
    }
}

impl NodeVerdicts {
    /// Takes in one watch event.
    pub fn apply(&self, event: Event<PartialObjectMeta<Node>>) {
        let mut lists = self.lists.write().unwrap_or_else(|p| p.into_inner());
        match event {
            Event::Init => lists.listing = Some(Entries::default()),
            Event::InitApply(n) => {
                if let Some(listing) = lists.listing.as_mut() {
                    insert(listing, &n);
                }
            }
            Event::InitDone => {
                if let Some(mut listed) = lists.listing.take() {
                    listed.shrink_to_fit();
                    let replaced = std::mem::replace(&mut lists.live, listed);
                    drop(lists);
                    drop(replaced);
                } else {
                    drop(lists);
                }
                // A list's pages were freed in the allocator's arenas: hand them back, or
                // they stay resident until the arenas are reused.
                meshgate_shell::alloc::trim();
                self.listed.send_replace(true);
            }
            Event::Apply(n) => insert(&mut lists.live, &n),
            Event::Delete(n) => {
                if let Some(name) = n.metadata.name.as_deref() {
                    lists.live.remove(name);
                }
            }
        }
    }

    /// The labels the decision reads of Node `name` (only the verified label, when the Node
    /// carries it); `None` for a Node the cache does not know.
    pub fn labels(&self, name: &str) -> Option<BTreeMap<String, String>> {
        let lists = self.lists.read().unwrap_or_else(|p| p.into_inner());
        let v = lists.live.get(name)?;
        Some(
            v.value()
                .map(|v| (VERIFIED_LABEL.to_string(), v.to_string()))
                .into_iter()
                .collect(),
        )
    }

    /// Whether the cache knows Node `name`.
    pub fn contains(&self, name: &str) -> bool {
        let lists = self.lists.read().unwrap_or_else(|p| p.into_inner());
        lists.live.get(name).is_some()
    }

    /// How many Nodes the cache knows.
    pub fn len(&self) -> usize {
        let lists = self.lists.read().unwrap_or_else(|p| p.into_inner());
        lists.live.len()
    }

    /// Whether the cache knows no Node.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Returns once the first list is in (at once if it already is).
    pub async fn wait_until_listed(&self) {
        let mut rx = self.listed.subscribe();
        // The sender lives in `self`, borrowed for the wait: it cannot be dropped.
        let _ = rx.wait_for(|listed| *listed).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt as _;
    use kube::api::ObjectMeta;

    fn node(name: &str, verified: Option<&str>) -> PartialObjectMeta<Node> {
        let mut labels = BTreeMap::from([
            ("kubernetes.io/hostname".to_string(), name.to_string()),
            ("topology.kubernetes.io/zone".to_string(), "a".to_string()),
        ]);
        if let Some(v) = verified {
            labels.insert(VERIFIED_LABEL.to_string(), v.to_string());
        }
        PartialObjectMeta {
            types: None,
            metadata: ObjectMeta {
                name: Some(name.into()),
                labels: Some(labels),
                annotations: Some([("a".to_string(), "b".to_string())].into()),
                ..ObjectMeta::default()
            },
            _phantom: std::marker::PhantomData,
        }
    }

    fn verified(v: &str) -> Option<BTreeMap<String, String>> {
        Some(BTreeMap::from([(
            VERIFIED_LABEL.to_string(),
            v.to_string(),
        )]))
    }

    #[test]
    fn a_cached_node_keeps_only_the_verified_label() {
        let cache = NodeVerdicts::default();
        for e in [
            Event::Init,
            Event::InitApply(node("a", Some("true"))),
            Event::InitApply(node("b", None)),
            Event::InitApply(node("c", Some("maybe"))),
            Event::InitDone,
        ] {
            cache.apply(e);
        }
        assert_eq!(cache.labels("a"), verified("true"));
        assert_eq!(cache.labels("b"), Some(BTreeMap::new()));
        assert_eq!(
            cache.labels("c"),
            verified("maybe"),
            "other values kept as is"
        );
        assert_eq!(cache.labels("d"), None);
        assert!(cache.contains("b") && !cache.contains("d"));
        assert_eq!(cache.len(), 3);
    }

    #[test]
    fn changes_after_the_list_follow_the_watch() {
        let cache = NodeVerdicts::default();
        cache.apply(Event::Init);
        cache.apply(Event::InitApply(node("a", Some("false"))));
        cache.apply(Event::InitDone);
        cache.apply(Event::Apply(node("a", Some("true"))));
        cache.apply(Event::Apply(node("new", Some("false"))));
        assert_eq!(cache.labels("a"), verified("true"));
        assert_eq!(cache.labels("new"), verified("false"));
        cache.apply(Event::Delete(node("a", Some("true"))));
        assert_eq!(cache.labels("a"), None);
        assert_eq!(cache.len(), 1);
    }

    #[test]
    fn a_relist_is_swapped_in_whole_and_readiness_waits_for_the_first() {
        let cache = NodeVerdicts::default();
        cache.apply(Event::Init);
        cache.apply(Event::InitApply(node("a", Some("true"))));
        // Listing: nothing answered yet, not ready.
        assert_eq!(cache.labels("a"), None);
        assert!(cache.wait_until_listed().now_or_never().is_none());
        cache.apply(Event::InitApply(node("b", Some("true"))));
        cache.apply(Event::InitDone);
        assert!(cache.wait_until_listed().now_or_never().is_some());
        // A relist (after a watch expired): the old view answers until it is done, then the
        // Node deleted meanwhile is gone.
        cache.apply(Event::Init);
        cache.apply(Event::InitApply(node("a", Some("false"))));
        assert_eq!(cache.labels("b"), verified("true"));
        assert_eq!(cache.labels("a"), verified("true"));
        cache.apply(Event::InitDone);
        assert_eq!(cache.labels("a"), verified("false"));
        assert_eq!(cache.labels("b"), None);
        assert!(cache.wait_until_listed().now_or_never().is_some());
    }
}
