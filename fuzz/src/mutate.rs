//! Input generation: a deterministic random generator and the mutations applied to seeds.
//!
//! In: a parent input, the current corpus (for splicing), a dictionary of tokens that matter
//! to the target, and whether the target reads JSON. Out: a child input of at most
//! `max_len` bytes. Everything is driven by [`Rng`], so a run is reproducible from its seed.
//!
//! Byte mutations follow the classic AFL/libFuzzer set (bit flips, interesting integers,
//! arithmetic on 8/16/32-bit fields in both byte orders — netlink lengths are native-endian,
//! ports big-endian —, block deletion, insertion, duplication, splicing, dictionary tokens).
//! JSON targets also get structural mutations on the parsed value (replace a node with
//! another type, drop or duplicate members, deep nesting, huge numbers, odd strings), which
//! reach the decoders' semantic checks instead of stopping at the JSON syntax error.

use serde_json::{Map, Value};

/// splitmix64: tiny, fast, and good enough to drive mutations.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }

    /// True once in `n` draws.
    pub fn one_in(&mut self, n: usize) -> bool {
        self.below(n.max(1)) == 0
    }

    /// A random byte.
    pub fn byte(&mut self) -> u8 {
        self.next_u64() as u8
    }

    /// One element of a non-empty slice.
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> Option<&'a T> {
        if items.is_empty() {
            None
        } else {
            items.get(self.below(items.len()))
        }
    }
}

/// Integers that sit on boundaries: zero, sign bits, all-ones, powers of two around sizes.
const INTERESTING: &[u64] = &[
    0,
    1,
    2,
    3,
    4,
    7,
    8,
    15,
    16,
    20,
    31,
    32,
    63,
    64,
    84,
    100,
    127,
    128,
    255,
    256,
    512,
    1000,
    1024,
    4096,
    32767,
    32768,
    65535,
    65536,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_fffe,
    0xffff_ffff,
    u64::MAX,
];

/// How a target's inputs are mutated.
#[derive(Clone, Debug, Default)]
pub struct Mutator {
    /// Tokens worth inserting (JSON keys and values, magic names).
    pub dictionary: Vec<Vec<u8>>,
    /// The target reads JSON: add structural mutations of the parsed value.
    pub json: bool,
    /// Upper bound of a child's size.
    pub max_len: usize,
}

impl Mutator {
    /// A child of `parent`: one to five stacked mutations (a JSON mutation counts as one).
    pub fn mutate(&self, rng: &mut Rng, parent: &[u8], corpus: &[Vec<u8>]) -> Vec<u8> {
        let mut data = parent.to_vec();
        if self.json
            && rng.one_in(3)
            && let Some(child) = self.mutate_json(rng, &data)
        {
            data = child;
            if rng.one_in(2) {
                self.cap(&mut data);
                return data;
            }
        }
        let rounds = 1 + rng.below(5);
        for _ in 0..rounds {
            self.mutate_bytes(rng, &mut data, corpus);
        }
        self.cap(&mut data);
        data
    }

    fn cap(&self, data: &mut Vec<u8>) {
        let max = if self.max_len == 0 {
            64 * 1024
        } else {
            self.max_len
        };
        data.truncate(max);
    }

    fn mutate_bytes(&self, rng: &mut Rng, data: &mut Vec<u8>, corpus: &[Vec<u8>]) {
        let len = data.len();
        match rng.below(13) {
            // Flip one bit.
            0 if len > 0 => {
                let i = rng.below(len);
                data[i] ^= 1 << rng.below(8);
            }
            // Set a random byte.
            1 if len > 0 => {
                let i = rng.below(len);
                data[i] = rng.byte();
            }
            // Overwrite an 8/16/32-bit field with an interesting value, either byte order.
            2 if len > 0 => overwrite_interesting(rng, data),
            // Add or subtract a small number to a 16/32-bit native-endian field (lengths).
            3 if len >= 2 => add_small(rng, data),
            // Delete a block.
            4 if len > 0 => {
                let at = rng.below(len);
                let n = 1 + rng.below((len - at).min(64));
                data.drain(at..at + n);
            }
            // Insert random bytes.
            5 => {
                let at = rng.below(len + 1);
                let n = 1 + rng.below(16);
                let bytes: Vec<u8> = (0..n).map(|_| rng.byte()).collect();
                data.splice(at..at, bytes);
            }
            // Duplicate a block somewhere else (repeated attributes, entries, members).
            6 if len > 0 => {
                let from = rng.below(len);
                let n = 1 + rng.below((len - from).min(256));
                let block = data[from..from + n].to_vec();
                let at = rng.below(len + 1);
                data.splice(at..at, block);
            }
            // Truncate.
            7 if len > 0 => {
                let at = rng.below(len);
                data.truncate(at);
            }
            // Splice: this input's head with another corpus entry's tail.
            8 => {
                if let Some(other) = rng.pick(corpus) {
                    let cut = rng.below(len + 1);
                    let from = rng.below(other.len() + 1);
                    data.truncate(cut);
                    data.extend_from_slice(&other[from..]);
                }
            }
            // Insert or overwrite with a dictionary token.
            9 | 10 => {
                if let Some(tok) = rng.pick(&self.dictionary) {
                    let at = rng.below(len + 1);
                    if rng.one_in(2) || at + tok.len() > len {
                        data.splice(at..at, tok.iter().copied());
                    } else {
                        data[at..at + tok.len()].copy_from_slice(tok);
                    }
                }
            }
            // Swap two bytes.
            11 if len > 1 => {
                let (a, b) = (rng.below(len), rng.below(len));
                data.swap(a, b);
            }
            // Fill a block with one value (zeroed or 0xff runs: empty names, huge lengths).
            _ if len > 0 => {
                let at = rng.below(len);
                let n = 1 + rng.below((len - at).min(32));
                let v = [0u8, 0xff, rng.byte()][rng.below(3)];
                data[at..at + n].fill(v);
            }
            _ => data.push(rng.byte()),
        }
    }

    /// Parses `data` as JSON and mutates one node of it; `None` when it is not JSON.
    fn mutate_json(&self, rng: &mut Rng, data: &[u8]) -> Option<Vec<u8>> {
        let mut value: Value = serde_json::from_slice(data).ok()?;
        let nodes = count_nodes(&value);
        let target = rng.below(nodes);
        let mut seen = 0usize;
        mutate_node(rng, &mut value, target, &mut seen, &self.dictionary);
        serde_json::to_vec(&value).ok()
    }
}

/// Overwrites an 8/16/32-bit field of `data` (not empty) with an interesting value, either byte
/// order.
fn overwrite_interesting(rng: &mut Rng, data: &mut [u8]) {
    let len = data.len();
    let width = [1usize, 2, 4][rng.below(3)].min(len);
    let at = rng.below(len - width + 1);
    let v = rng.pick(INTERESTING).copied().unwrap_or(0);
    let bytes = if rng.one_in(2) {
        v.to_le_bytes()
    } else {
        v.to_be_bytes()
    };
    let src = if rng.one_in(2) {
        &bytes[..width]
    } else {
        &bytes[8 - width..]
    };
    data[at..at + width].copy_from_slice(src);
}

/// Adds or subtracts a small number to a 16/32-bit native-endian field of `data` (at least 2
/// bytes long): lengths just off by a few.
fn add_small(rng: &mut Rng, data: &mut [u8]) {
    let len = data.len();
    let width = if len >= 4 && rng.one_in(2) { 4 } else { 2 };
    let at = rng.below(len - width + 1);
    let delta = 1 + rng.below(35) as u32;
    let sub = rng.one_in(2);
    if width == 2 {
        let mut b = [0u8; 2];
        b.copy_from_slice(&data[at..at + 2]);
        let v = u16::from_ne_bytes(b);
        let v = if sub {
            v.wrapping_sub(delta as u16)
        } else {
            v.wrapping_add(delta as u16)
        };
        data[at..at + 2].copy_from_slice(&v.to_ne_bytes());
    } else {
        let mut b = [0u8; 4];
        b.copy_from_slice(&data[at..at + 4]);
        let v = u32::from_ne_bytes(b);
        let v = if sub {
            v.wrapping_sub(delta)
        } else {
            v.wrapping_add(delta)
        };
        data[at..at + 4].copy_from_slice(&v.to_ne_bytes());
    }
}

fn count_nodes(v: &Value) -> usize {
    1 + match v {
        Value::Array(a) => a.iter().map(count_nodes).sum(),
        Value::Object(o) => o.values().map(count_nodes).sum(),
        _ => 0,
    }
}

/// Walks the value in pre-order and mutates node number `target`.
fn mutate_node(rng: &mut Rng, v: &mut Value, target: usize, seen: &mut usize, dict: &[Vec<u8>]) {
    if *seen == target {
        *seen += 1;
        mutate_here(rng, v, dict);
        return;
    }
    *seen += 1;
    match v {
        Value::Array(a) => {
            for item in a {
                if *seen > target {
                    return;
                }
                mutate_node(rng, item, target, seen, dict);
            }
        }
        Value::Object(o) => {
            for item in o.values_mut() {
                if *seen > target {
                    return;
                }
                mutate_node(rng, item, target, seen, dict);
            }
        }
        _ => {}
    }
}

fn dict_string(rng: &mut Rng, dict: &[Vec<u8>]) -> String {
    rng.pick(dict)
        .map(|t| String::from_utf8_lossy(t).trim_matches('"').to_string())
        .unwrap_or_default()
}

/// A random JSON value of small depth.
fn random_value(rng: &mut Rng, dict: &[Vec<u8>], depth: usize) -> Value {
    match rng.below(if depth == 0 { 6 } else { 8 }) {
        0 => Value::Null,
        1 => Value::Bool(rng.one_in(2)),
        2 => {
            let v = rng.pick(INTERESTING).copied().unwrap_or(0);
            if rng.one_in(3) {
                serde_json::json!(-(v as i64))
            } else {
                serde_json::json!(v)
            }
        }
        3 => serde_json::Number::from_f64(f64::from_bits(rng.next_u64()))
            .map_or(Value::Null, Value::Number),
        4 => Value::String(dict_string(rng, dict)),
        5 => {
            // Odd strings: empty, long, control characters, non-ASCII, path-ish.
            let s = match rng.below(6) {
                0 => String::new(),
                1 => "x".repeat(1 + rng.below(5000)),
                2 => "\u{0}\u{7}\u{1b}[31m\n\t".into(),
                3 => "ünï\u{202e}cödé🦀".into(),
                4 => "../../etc/passwd".into(),
                _ => "1.0.0".into(),
            };
            Value::String(s)
        }
        6 => Value::Array(
            (0..rng.below(4))
                .map(|_| random_value(rng, dict, depth - 1))
                .collect(),
        ),
        _ => {
            let mut m = Map::new();
            for _ in 0..rng.below(4) {
                m.insert(dict_string(rng, dict), random_value(rng, dict, depth - 1));
            }
            Value::Object(m)
        }
    }
}

fn mutate_here(rng: &mut Rng, v: &mut Value, dict: &[Vec<u8>]) {
    match rng.below(6) {
        // Replace with anything.
        0 | 1 => *v = random_value(rng, dict, 2),
        // Wrap in deep nesting (recursion limits of decoders).
        2 => {
            let depth = 1 + rng.below(200);
            let mut inner = v.take();
            for _ in 0..depth {
                inner = if rng.one_in(2) {
                    Value::Array(vec![inner])
                } else {
                    let mut m = Map::new();
                    m.insert("a".into(), inner);
                    Value::Object(m)
                };
            }
            *v = inner;
        }
        // Containers: drop, duplicate or add a member.
        _ => match v {
            Value::Array(a) if !a.is_empty() => {
                let i = rng.below(a.len());
                match rng.below(3) {
                    0 => {
                        a.remove(i);
                    }
                    1 => {
                        let copies = 1 + rng.below(8);
                        let item = a[i].clone();
                        for _ in 0..copies {
                            a.push(item.clone());
                        }
                    }
                    _ => a.insert(i, random_value(rng, dict, 1)),
                }
            }
            Value::Object(o) if !o.is_empty() => {
                let keys: Vec<String> = o.keys().cloned().collect();
                let key = keys[rng.below(keys.len())].clone();
                match rng.below(3) {
                    0 => {
                        o.remove(&key);
                    }
                    1 => {
                        o.insert(dict_string(rng, dict), random_value(rng, dict, 1));
                    }
                    _ => {
                        // Same value under another key, or the key's value's type changed.
                        if let Some(val) = o.get(&key).cloned() {
                            o.insert(format!("{key}{}", rng.below(3)), val);
                        }
                    }
                }
            }
            other => *other = random_value(rng, dict, 1),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_generator_is_deterministic_and_spreads() {
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        let xs: Vec<u64> = (0..100).map(|_| a.next_u64()).collect();
        let ys: Vec<u64> = (0..100).map(|_| b.next_u64()).collect();
        assert_eq!(xs, ys);
        let mut hist = [0usize; 10];
        let mut r = Rng::new(1);
        for _ in 0..10_000 {
            hist[r.below(10)] += 1;
        }
        assert!(hist.iter().all(|&n| (800..1200).contains(&n)), "{hist:?}");
    }

    #[test]
    fn mutations_change_inputs_and_respect_the_size_cap() {
        let m = Mutator {
            dictionary: vec![b"\"plugins\"".to_vec()],
            json: true,
            max_len: 300,
        };
        let seed = br#"{"cniVersion":"1.0.0","name":"k8s","plugins":[{"type":"calico"}]}"#;
        let mut rng = Rng::new(3);
        let mut changed = 0;
        for _ in 0..1000 {
            let child = m.mutate(&mut rng, seed, &[seed.to_vec()]);
            assert!(child.len() <= 300);
            changed += usize::from(child != seed);
        }
        assert!(
            changed > 900,
            "{changed} of 1000 children differ from the seed"
        );
    }

    #[test]
    fn json_mutations_keep_json_valid() {
        let m = Mutator {
            dictionary: vec![],
            json: true,
            max_len: 1 << 20,
        };
        let mut rng = Rng::new(11);
        let seed = br#"{"a":[1,2,{"b":null}],"c":"d"}"#;
        for _ in 0..500 {
            let child = m.mutate_json(&mut rng, seed).expect("seed is JSON");
            // Deep nesting is meant to exceed decoders' recursion limits; anything else must
            // still be JSON.
            match serde_json::from_slice::<Value>(&child) {
                Ok(_) => {}
                Err(e) => assert!(e.to_string().contains("recursion limit"), "{e}"),
            }
        }
    }
}
