//! A set of Node names with a small value each, packed so a fleet's worth stays small.
//!
//! In: names with their value, inserted and removed one by one. Out: the value by name, and
//! the count.
//!
//! Why not a `HashMap<Box<str>, V>`: each name is then an allocation of its own, made while
//! the watcher's list page (hundreds of decoded objects, thousands of small allocations) is
//! alive around it. When the page is freed, the names stay scattered over its pages, and each
//! keeps a whole page resident that `malloc_trim` cannot return: measured, 1.5 KB of RSS per
//! Node at 10,000 Nodes against about 80 bytes of data. Here the names are appended to one
//! buffer and found through a hash table of offsets; both are single blocks (past the mmap
//! threshold at fleet sizes, so freed whole), and nothing the cache keeps lies among a
//! list's garbage.

use std::hash::BuildHasher;

use hashbrown::HashTable;

/// Where a name lies in the buffer, and its value.
struct Slot<V> {
    start: u32,
    len: u32,
    value: V,
}

/// Names packed in one buffer, each with a value.
pub(super) struct NameTable<V> {
    text: String,
    slots: HashTable<Slot<V>>,
    hasher: std::hash::RandomState,
    /// Bytes of `text` no slot points to any more (removed names).
    dead: usize,
}

/// Dead bytes tolerated before the buffer is rewritten: below this, a rewrite saves little.
const COMPACT_FLOOR: usize = 64 * 1024;

impl<V> Default for NameTable<V> {
    fn default() -> Self {
        Self {
            text: String::new(),
            slots: HashTable::new(),
            hasher: std::hash::RandomState::new(),
            dead: 0,
        }
    }
}

impl<V> NameTable<V> {
    fn name<'a>(text: &'a str, slot: &Slot<V>) -> &'a str {
        let start = slot.start as usize;
        &text[start..start + slot.len as usize]
    }

    /// The value of `name`, if the table has it.
    pub(super) fn get(&self, name: &str) -> Option<&V> {
        let hash = self.hasher.hash_one(name);
        self.slots
            .find(hash, |s| Self::name(&self.text, s) == name)
            .map(|s| &s.value)
    }

    /// Sets the value of `name`, adding the name if it is new. A name whose offset would not
    /// fit 32 bits (over 4 GiB of names: far past any cluster) is not added; returns whether
    /// the table has `name` afterwards.
    pub(super) fn insert(&mut self, name: &str, value: V) -> bool {
        let hash = self.hasher.hash_one(name);
        let text = &self.text;
        if let Some(slot) = self.slots.find_mut(hash, |s| Self::name(text, s) == name) {
            slot.value = value;
            return true;
        }
        let (Ok(start), Ok(len)) = (u32::try_from(self.text.len()), u32::try_from(name.len()))
        else {
            return false;
        };
        if start.checked_add(len).is_none() {
            return false;
        }
        self.text.push_str(name);
        let (text, hasher) = (&self.text, &self.hasher);
        self.slots
            .insert_unique(hash, Slot { start, len, value }, |s| {
                hasher.hash_one(Self::name(text, s))
            });
        true
    }

    /// Removes `name`; its bytes are reclaimed once dead bytes outweigh live ones.
    pub(super) fn remove(&mut self, name: &str) {
        let hash = self.hasher.hash_one(name);
        let text = &self.text;
        if let Ok(entry) = self.slots.find_entry(hash, |s| Self::name(text, s) == name) {
            let (slot, _) = entry.remove();
            self.dead += slot.len as usize;
        }
        if self.dead > COMPACT_FLOOR && self.dead > self.text.len() / 2 {
            self.compact();
        }
    }

    /// Rewrites the buffer with only the live names, in one allocation of their size.
    fn compact(&mut self) {
        let mut text = String::with_capacity(self.text.len() - self.dead);
        for slot in self.slots.iter_mut() {
            let name = Self::name(&self.text, slot);
            // Fits: the new buffer is shorter than the old one, whose offsets fit.
            slot.start = text.len() as u32;
            text.push_str(name);
        }
        self.text = text;
        self.dead = 0;
    }

    /// Gives back the spare capacity of a table built in one go (a list).
    pub(super) fn shrink_to_fit(&mut self) {
        self.text.shrink_to_fit();
        let (text, hasher) = (&self.text, &self.hasher);
        self.slots
            .shrink_to_fit(|s| hasher.hash_one(Self::name(text, s)));
    }

    /// How many names the table has.
    pub(super) fn len(&self) -> usize {
        self.slots.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_found_updated_and_removed() {
        let mut t = NameTable::default();
        assert!(t.insert("a", 1));
        assert!(t.insert("bb", 2));
        assert!(t.insert("a", 3), "an update, not a second entry");
        assert_eq!(t.len(), 2);
        assert_eq!(
            (t.get("a"), t.get("bb"), t.get("b")),
            (Some(&3), Some(&2), None)
        );
        // A name that is a prefix or a suffix of the buffer's neighbours is not confused.
        assert_eq!(t.get("ab"), None);
        t.remove("a");
        t.remove("missing");
        assert_eq!((t.get("a"), t.get("bb"), t.len()), (None, Some(&2), 1));
    }

    #[test]
    fn removals_are_compacted_away_and_lookups_still_answer() {
        let mut t = NameTable::default();
        let name = |i: usize| format!("gke-fleet-default-pool-3f2a9c00-{i:05}");
        for i in 0..10_000 {
            t.insert(&name(i), i);
        }
        let full = t.text.len();
        for i in (0..10_000).filter(|i| i % 4 != 0) {
            t.remove(&name(i));
        }
        // Dead bytes never outweigh live ones by more than the floor.
        let live = full / 4;
        assert!(
            t.text.len() <= 2 * live + COMPACT_FLOOR && t.text.len() < full,
            "dead names were kept: {} bytes for {live} live of {full}",
            t.text.len()
        );
        assert_eq!(t.len(), 2_500);
        for i in 0..10_000 {
            let want = (i % 4 == 0).then_some(i);
            assert_eq!(t.get(&name(i)).copied(), want, "{}", name(i));
        }
        t.shrink_to_fit();
        assert_eq!(t.get(&name(0)), Some(&0));
    }
}
