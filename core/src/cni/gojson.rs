//! JSON decoded the way Go's `encoding/json` decodes it, because libcni decides what a CNI
//! config *is* with Go's decoder, and every difference is a config one side loads and the
//! other does not.
//!
//! In: bytes. Out: a [`GoValue`] tree that keeps every object member in document order,
//! duplicates included (Go's struct decoding sees them all; its map decoding keeps the last),
//! or a [`JsonError`] that names a byte offset and never quotes the input.
//!
//! What Go does and serde_json does not, all mirrored here:
//! - invalid UTF-8 inside strings is accepted and each bad byte becomes U+FFFD (Go
//!   `decode.go` `unquoteBytes`); a lone UTF-16 surrogate escape becomes U+FFFD as well;
//! - nesting is allowed up to 10000 levels (Go `scanner.go` `maxNestingDepth`), so the
//!   parser is iterative and cannot overflow the stack;
//! - numbers are kept as text: Go only converts a number when it lands in a `float64`
//!   (`interface{}`), and a number beyond `float64` range is then an error
//!   ([`GoValue::numbers_fit_f64`]).
//!
//! Field matching for typed structs (exact name first, then Go's case folding) is
//! [`field_matches`].

/// Go's `maxNestingDepth` in `encoding/json/scanner.go`: the scanner refuses the 10,001st
/// open bracket with "exceeded max depth".
pub const MAX_DEPTH: usize = 10_000;

/// How many levels `Debug` shows before it elides a subtree: formatting recurses, so it is
/// bounded here rather than by the input.
pub const DEBUG_DEPTH: usize = 16;

/// A decoded JSON value, Go style.
///
/// Trees may be [`MAX_DEPTH`] levels deep, so nothing that walks one recurses: dropping,
/// comparing and [`GoValue::as_go_map`] use explicit stacks, and `Debug` stops at
/// [`DEBUG_DEPTH`] levels. There is deliberately no `Clone`: a derived one would recurse.
pub enum GoValue {
    /// `null`.
    Null,
    /// `true` / `false`.
    Bool(bool),
    /// A number, as written (already checked against the JSON number grammar).
    Number(String),
    /// A string, with invalid UTF-8 and lone surrogates replaced by U+FFFD.
    String(String),
    /// An array.
    Array(Vec<GoValue>),
    /// An object: every member in document order, duplicates kept.
    Object(Vec<(String, GoValue)>),
}

/// Why bytes are not JSON for Go. Carries an offset, never input bytes.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum JsonError {
    /// A byte that the JSON grammar does not allow at this point.
    #[error("invalid JSON at byte {0}")]
    Syntax(usize),
    /// The input ends inside a value.
    #[error("JSON ends unexpectedly at byte {0}")]
    Eof(usize),
    /// More than [`MAX_DEPTH`] nested arrays/objects.
    #[error("JSON nested more than {MAX_DEPTH} levels")]
    TooDeep,
}

impl GoValue {
    /// The JSON type name, as Go's `UnmarshalTypeError` would call it.
    pub fn kind(&self) -> &'static str {
        match self {
            GoValue::Null => "null",
            GoValue::Bool(_) => "bool",
            GoValue::Number(_) => "number",
            GoValue::String(_) => "string",
            GoValue::Array(_) => "array",
            GoValue::Object(_) => "object",
        }
    }

    /// True when every number in the tree converts to a finite `float64`, which Go requires
    /// when it decodes into `interface{}` (`strconv.ParseFloat` returns `ErrRange` past
    /// ±MaxFloat64; underflow to 0 is not an error).
    pub fn numbers_fit_f64(&self) -> bool {
        let mut stack = vec![self];
        while let Some(v) = stack.pop() {
            match v {
                GoValue::Number(n) if !n.parse::<f64>().is_ok_and(f64::is_finite) => {
                    return false;
                }
                GoValue::Array(items) => stack.extend(items.iter()),
                GoValue::Object(members) => stack.extend(members.iter().map(|(_, v)| v)),
                _ => {}
            }
        }
        true
    }

    /// How many arrays and objects nest at the deepest point (a scalar is 0): what Go's
    /// scanner counts against [`MAX_DEPTH`] when the value is encoded and decoded again.
    pub fn depth(&self) -> usize {
        let mut deepest = 0;
        let mut stack = vec![(self, 1)];
        while let Some((v, d)) = stack.pop() {
            match v {
                GoValue::Array(items) => {
                    deepest = deepest.max(d);
                    stack.extend(items.iter().map(|c| (c, d + 1)));
                }
                GoValue::Object(members) => {
                    deepest = deepest.max(d);
                    stack.extend(members.iter().map(|(_, c)| (c, d + 1)));
                }
                _ => {}
            }
        }
        deepest
    }

    /// The value as Go's `map[string]interface{}` holds it, re-marshalled: in every object
    /// the last of duplicate keys wins and the keys come out sorted bytewise (Go's
    /// `json.Marshal` sorts map keys). This is what libcni's `NetworkConfFromBytes` hands to
    /// the typed plugin decoder, so field order (and thus which duplicate wins in a struct)
    /// follows from it.
    ///
    /// A post-order walk on explicit stacks: `todo` holds what is left to visit or to
    /// assemble, `done` the finished values, children in order, waiting for their parent.
    pub fn as_go_map(&self) -> GoValue {
        enum Step<'a> {
            Visit(&'a GoValue),
            Array(usize),
            Object(Vec<String>),
        }
        let mut todo = vec![Step::Visit(self)];
        let mut done: Vec<GoValue> = Vec::new();
        while let Some(step) = todo.pop() {
            match step {
                Step::Visit(GoValue::Array(items)) => {
                    todo.push(Step::Array(items.len()));
                    todo.extend(items.iter().rev().map(Step::Visit));
                }
                Step::Visit(GoValue::Object(members)) => {
                    let mut map = std::collections::BTreeMap::new();
                    for (k, v) in members {
                        map.insert(k.as_str(), v);
                    }
                    todo.push(Step::Object(map.keys().map(|k| k.to_string()).collect()));
                    todo.extend(map.values().rev().map(|v| Step::Visit(v)));
                }
                Step::Visit(leaf) => done.push(leaf.clone_leaf()),
                Step::Array(n) => {
                    let items = done.split_off(done.len().saturating_sub(n));
                    done.push(GoValue::Array(items));
                }
                Step::Object(keys) => {
                    let values = done.split_off(done.len().saturating_sub(keys.len()));
                    done.push(GoValue::Object(keys.into_iter().zip(values).collect()));
                }
            }
        }
        done.pop().unwrap_or(GoValue::Null)
    }

    /// A copy of a scalar; a container comes back empty (callers copy children themselves).
    fn clone_leaf(&self) -> GoValue {
        match self {
            GoValue::Null => GoValue::Null,
            GoValue::Bool(b) => GoValue::Bool(*b),
            GoValue::Number(n) => GoValue::Number(n.clone()),
            GoValue::String(s) => GoValue::String(s.clone()),
            GoValue::Array(_) => GoValue::Array(Vec::new()),
            GoValue::Object(_) => GoValue::Object(Vec::new()),
        }
    }

    /// True for an array or object with at least one child.
    fn has_children(&self) -> bool {
        match self {
            GoValue::Array(items) => !items.is_empty(),
            GoValue::Object(members) => !members.is_empty(),
            _ => false,
        }
    }

    /// Moves the children that have children of their own into `into`; the rest drop here.
    fn take_nested(&mut self, into: &mut Vec<GoValue>) {
        match self {
            GoValue::Array(items) => {
                into.extend(items.drain(..).filter(GoValue::has_children));
            }
            GoValue::Object(members) => {
                into.extend(
                    members
                        .drain(..)
                        .map(|(_, v)| v)
                        .filter(GoValue::has_children),
                );
            }
            _ => {}
        }
    }

    /// The last member named exactly `key` (Go map lookup after decoding).
    pub fn get_exact(&self, key: &str) -> Option<&GoValue> {
        match self {
            GoValue::Object(members) => {
                members.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v)
            }
            _ => None,
        }
    }
}

/// The derived drop would recurse once per level: a 10,000-deep tree overflows a 2 MiB
/// stack. Nested containers are moved onto a heap stack and dropped one level at a time.
impl Drop for GoValue {
    fn drop(&mut self) {
        if !self.has_children() {
            return;
        }
        let mut pending = Vec::new();
        self.take_nested(&mut pending);
        while let Some(mut v) = pending.pop() {
            v.take_nested(&mut pending);
        }
    }
}

/// Structural equality, on an explicit stack (a derived `eq` would recurse).
impl PartialEq for GoValue {
    fn eq(&self, other: &Self) -> bool {
        let mut pairs = vec![(self, other)];
        while let Some(pair) = pairs.pop() {
            match pair {
                (GoValue::Null, GoValue::Null) => {}
                (GoValue::Bool(a), GoValue::Bool(b)) if a == b => {}
                (GoValue::Number(a), GoValue::Number(b)) if a == b => {}
                (GoValue::String(a), GoValue::String(b)) if a == b => {}
                (GoValue::Array(a), GoValue::Array(b)) if a.len() == b.len() => {
                    pairs.extend(a.iter().zip(b));
                }
                (GoValue::Object(a), GoValue::Object(b)) if a.len() == b.len() => {
                    for ((ka, va), (kb, vb)) in a.iter().zip(b) {
                        if ka != kb {
                            return false;
                        }
                        pairs.push((va, vb));
                    }
                }
                _ => return false,
            }
        }
        true
    }
}

impl std::fmt::Debug for GoValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        Shown(self, DEBUG_DEPTH).fmt(f)
    }
}

/// A value shown down to a number of levels (formatting recurses; the bound keeps it short).
struct Shown<'a>(&'a GoValue, usize);

impl std::fmt::Debug for Shown<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Shown(v, depth) = *self;
        match v {
            GoValue::Null => f.write_str("Null"),
            GoValue::Bool(b) => f.debug_tuple("Bool").field(b).finish(),
            GoValue::Number(n) => f.debug_tuple("Number").field(n).finish(),
            GoValue::String(s) => f.debug_tuple("String").field(s).finish(),
            v if depth == 0 => write!(
                f,
                "{}(…)",
                if matches!(v, GoValue::Array(_)) {
                    "Array"
                } else {
                    "Object"
                }
            ),
            GoValue::Array(items) => {
                let list = Entries(items.iter().map(|v| (None, Shown(v, depth - 1))).collect());
                f.debug_tuple("Array").field(&list).finish()
            }
            GoValue::Object(members) => {
                let list = Entries(
                    members
                        .iter()
                        .map(|(k, v)| (Some(k.as_str()), Shown(v, depth - 1)))
                        .collect(),
                );
                f.debug_tuple("Object").field(&list).finish()
            }
        }
    }
}

/// Array items, or object members as `(key, value)`.
struct Entries<'a>(Vec<(Option<&'a str>, Shown<'a>)>);

impl std::fmt::Debug for Entries<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut list = f.debug_list();
        for (k, v) in &self.0 {
            match k {
                Some(k) => list.entry(&(k, v)),
                None => list.entry(v),
            };
        }
        list.finish()
    }
}

/// Whether a JSON object key selects the struct field whose JSON name is `field` (an ASCII
/// name such as `cniVersion`), the way Go's `encoding/json` matches: the exact name, or the
/// same name under Go's case folding (`foldName`: ASCII letters fold to upper case, every
/// other rune to the smallest rune of its `unicode.SimpleFold` orbit). For ASCII field names
/// the only non-ASCII runes whose orbit holds an ASCII letter are U+212A KELVIN SIGN (k) and
/// U+017F LATIN SMALL LETTER LONG S (s), so those are the only ones that can match.
///
/// The caller tries exact matches across all fields first (Go's `byExactName`), then this.
pub fn field_matches(key: &str, field: &str) -> bool {
    let mut k = key.chars();
    for f in field.chars() {
        let Some(c) = k.next() else { return false };
        let same = c.eq_ignore_ascii_case(&f)
            || (c == '\u{212A}' && f.eq_ignore_ascii_case(&'k'))
            || (c == '\u{017F}' && f.eq_ignore_ascii_case(&'s'));
        if !same {
            return false;
        }
    }
    k.next().is_none()
}

/// Parses one JSON document, Go style (see the module docs).
pub fn parse(bytes: &[u8]) -> Result<GoValue, JsonError> {
    let mut p = Parser { b: bytes, i: 0 };
    let v = p.value()?;
    p.ws();
    if p.i != p.b.len() {
        return Err(JsonError::Syntax(p.i));
    }
    Ok(v)
}

enum Frame {
    Array(Vec<GoValue>),
    Object(Vec<(String, GoValue)>, String),
}

struct Parser<'a> {
    b: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn ws(&mut self) {
        while self.i < self.b.len() && matches!(self.b[self.i], b' ' | b'\t' | b'\n' | b'\r') {
            self.i += 1;
        }
    }

    fn peek(&self) -> Result<u8, JsonError> {
        self.b.get(self.i).copied().ok_or(JsonError::Eof(self.i))
    }

    fn expect(&mut self, c: u8) -> Result<(), JsonError> {
        if self.peek()? != c {
            return Err(JsonError::Syntax(self.i));
        }
        self.i += 1;
        Ok(())
    }

    /// An iterative value parser: containers live on an explicit stack.
    fn value(&mut self) -> Result<GoValue, JsonError> {
        let mut stack: Vec<Frame> = Vec::new();
        loop {
            let Some(mut done) = self.open(&mut stack)? else {
                continue;
            };
            // Attach finished values to their containers, closing containers as they end.
            loop {
                let Some(top) = stack.last_mut() else {
                    return Ok(done);
                };
                self.ws();
                match self.attach(top, done)? {
                    Some(closed) => {
                        stack.pop();
                        done = closed;
                    }
                    None => break,
                }
            }
        }
    }

    /// Parses the start of a value: a scalar or an empty container is finished (`Some`); a
    /// container with members is pushed on `stack` (`None`).
    fn open(&mut self, stack: &mut Vec<Frame>) -> Result<Option<GoValue>, JsonError> {
        self.ws();
        Ok(match self.peek()? {
            b'[' => {
                self.i += 1;
                if stack.len() >= MAX_DEPTH {
                    return Err(JsonError::TooDeep);
                }
                self.ws();
                if self.peek()? == b']' {
                    self.i += 1;
                    Some(GoValue::Array(Vec::new()))
                } else {
                    stack.push(Frame::Array(Vec::new()));
                    None
                }
            }
            b'{' => {
                self.i += 1;
                if stack.len() >= MAX_DEPTH {
                    return Err(JsonError::TooDeep);
                }
                self.ws();
                if self.peek()? == b'}' {
                    self.i += 1;
                    Some(GoValue::Object(Vec::new()))
                } else {
                    let key = self.key()?;
                    stack.push(Frame::Object(Vec::new(), key));
                    None
                }
            }
            b'"' => Some(GoValue::String(self.string()?)),
            b't' => self.literal(b"true", GoValue::Bool(true))?,
            b'f' => self.literal(b"false", GoValue::Bool(false))?,
            b'n' => self.literal(b"null", GoValue::Null)?,
            b'-' | b'0'..=b'9' => Some(GoValue::Number(self.number()?)),
            _ => return Err(JsonError::Syntax(self.i)),
        })
    }

    /// Adds a finished value to the innermost container. Returns the container when this
    /// closed it (the caller pops it), `None` when another member follows.
    fn attach(&mut self, top: &mut Frame, v: GoValue) -> Result<Option<GoValue>, JsonError> {
        match top {
            Frame::Array(items) => {
                items.push(v);
                match self.peek()? {
                    b',' => self.i += 1,
                    b']' => {
                        self.i += 1;
                        return Ok(Some(GoValue::Array(std::mem::take(items))));
                    }
                    _ => return Err(JsonError::Syntax(self.i)),
                }
            }
            Frame::Object(members, key) => {
                members.push((std::mem::take(key), v));
                match self.peek()? {
                    b',' => {
                        self.i += 1;
                        self.ws();
                        *key = self.key()?;
                    }
                    b'}' => {
                        self.i += 1;
                        return Ok(Some(GoValue::Object(std::mem::take(members))));
                    }
                    _ => return Err(JsonError::Syntax(self.i)),
                }
            }
        }
        Ok(None)
    }

    /// `"key" :` at the current position.
    fn key(&mut self) -> Result<String, JsonError> {
        if self.peek()? != b'"' {
            return Err(JsonError::Syntax(self.i));
        }
        let k = self.string()?;
        self.ws();
        self.expect(b':')?;
        Ok(k)
    }

    fn literal(&mut self, word: &[u8], v: GoValue) -> Result<Option<GoValue>, JsonError> {
        for &c in word {
            if self.peek()? != c {
                return Err(JsonError::Syntax(self.i));
            }
            self.i += 1;
        }
        Ok(Some(v))
    }

    fn digits(&mut self) -> usize {
        let start = self.i;
        while self.i < self.b.len() && self.b[self.i].is_ascii_digit() {
            self.i += 1;
        }
        self.i - start
    }

    /// `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?`
    fn number(&mut self) -> Result<String, JsonError> {
        let start = self.i;
        if self.peek()? == b'-' {
            self.i += 1;
        }
        match self.peek()? {
            b'0' => self.i += 1,
            b'1'..=b'9' => {
                self.digits();
            }
            _ => return Err(JsonError::Syntax(self.i)),
        }
        if self.b.get(self.i) == Some(&b'.') {
            self.i += 1;
            if self.digits() == 0 {
                return Err(self.eof_or_syntax());
            }
        }
        if matches!(self.b.get(self.i), Some(b'e' | b'E')) {
            self.i += 1;
            if matches!(self.b.get(self.i), Some(b'+' | b'-')) {
                self.i += 1;
            }
            if self.digits() == 0 {
                return Err(self.eof_or_syntax());
            }
        }
        // Only ASCII was consumed.
        Ok(String::from_utf8_lossy(&self.b[start..self.i]).into_owned())
    }

    fn eof_or_syntax(&self) -> JsonError {
        if self.i >= self.b.len() {
            JsonError::Eof(self.i)
        } else {
            JsonError::Syntax(self.i)
        }
    }

    fn hex4(&mut self) -> Result<u32, JsonError> {
        let mut v = 0u32;
        for _ in 0..4 {
            let c = self.peek()?;
            let d = (c as char).to_digit(16).ok_or(JsonError::Syntax(self.i))?;
            v = v * 16 + d;
            self.i += 1;
        }
        Ok(v)
    }

    /// A string at the current `"`, unquoted the way Go's `unquoteBytes` does.
    fn string(&mut self) -> Result<String, JsonError> {
        self.expect(b'"')?;
        let mut out = String::new();
        loop {
            let c = self.peek()?;
            match c {
                b'"' => {
                    self.i += 1;
                    return Ok(out);
                }
                b'\\' => {
                    self.i += 1;
                    let e = self.peek()?;
                    self.i += 1;
                    out.push(match e {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => self.unicode_escape()?,
                        _ => return Err(JsonError::Syntax(self.i - 1)),
                    });
                }
                0..=0x1f => return Err(JsonError::Syntax(self.i)),
                0x20..=0x7f => {
                    out.push(c as char);
                    self.i += 1;
                }
                _ => out.push(self.rune()),
            }
        }
    }

    /// The character of a `\uXXXX` escape whose `\u` was consumed.
    fn unicode_escape(&mut self) -> Result<char, JsonError> {
        let first = self.hex4()?;
        if !(0xD800..0xDC00).contains(&first) {
            return Ok(char::from_u32(first).unwrap_or('\u{FFFD}'));
        }
        // A valid pair is consumed whole; anything else leaves the next escape for the next
        // round and yields U+FFFD.
        let save = self.i;
        if self.b.get(self.i) == Some(&b'\\') && self.b.get(self.i + 1) == Some(&b'u') {
            self.i += 2;
            match self.hex4() {
                Ok(second) if (0xDC00..0xE000).contains(&second) => {
                    let cp = 0x10000 + ((first - 0xD800) << 10) + (second - 0xDC00);
                    return Ok(char::from_u32(cp).unwrap_or('\u{FFFD}'));
                }
                _ => self.i = save,
            }
        }
        Ok('\u{FFFD}')
    }

    /// A multi-byte sequence at the current position: the character if it is valid, else
    /// U+FFFD for its first byte alone, as Go's utf8.DecodeRune does.
    fn rune(&mut self) -> char {
        let rest = &self.b[self.i..self.b.len().min(self.i + 4)];
        let valid = match std::str::from_utf8(rest) {
            Ok(s) => s.chars().next(),
            Err(e) if e.valid_up_to() > 0 => std::str::from_utf8(&rest[..e.valid_up_to()])
                .ok()
                .and_then(|s| s.chars().next()),
            Err(_) => None,
        };
        match valid {
            Some(ch) => {
                self.i += ch.len_utf8();
                ch
            }
            None => {
                self.i += 1;
                '\u{FFFD}'
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_accepts_invalid_utf8_and_lone_surrogates() {
        let v = parse(b"{\"type\":\"cal\xffico\",\"x\":\"\\ud800\\u0041\"}").unwrap();
        assert_eq!(
            v.get_exact("type"),
            Some(&GoValue::String("cal\u{FFFD}ico".into()))
        );
        assert_eq!(v.get_exact("x"), Some(&GoValue::String("\u{FFFD}A".into())));
        let pair = parse(br#""\ud83d\ude00""#).unwrap();
        assert_eq!(pair, GoValue::String("\u{1F600}".into()));
    }

    #[test]
    fn grammar_and_depth() {
        for bad in [
            &b"{"[..],
            b"[1,]",
            b"{\"a\":1,}",
            b"01",
            b"1.",
            b"\"\x01\"",
            b"nul",
            b"{} x",
            b"\xef\xbb\xbf{}",
        ] {
            assert!(parse(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
        let deep_ok = format!("{}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
        assert!(parse(deep_ok.as_bytes()).is_ok());
        let too_deep = format!("{}{}", "[".repeat(MAX_DEPTH + 1), "]".repeat(MAX_DEPTH + 1));
        assert_eq!(parse(too_deep.as_bytes()), Err(JsonError::TooDeep));
        assert!(!parse(b"[1e400]").unwrap().numbers_fit_f64());
        assert!(parse(b"[1e-400, -0.5e3]").unwrap().numbers_fit_f64());
    }

    #[test]
    fn folding_matches_go() {
        assert!(field_matches("Type", "type"));
        assert!(field_matches("TYPE", "type"));
        assert!(field_matches("\u{212A}", "k"));
        assert!(field_matches("cniver\u{017F}ion", "cniVersion"));
        assert!(!field_matches("typ", "type"));
        assert!(!field_matches("\u{0131}pam", "ipam"));
    }

    #[test]
    fn go_map_keeps_last_duplicate_and_sorts() {
        let v = parse(br#"{"type":"a","Type":"b","type":"c"}"#)
            .unwrap()
            .as_go_map();
        assert_eq!(
            v,
            GoValue::Object(vec![
                ("Type".into(), GoValue::String("b".into())),
                ("type".into(), GoValue::String("c".into())),
            ])
        );
    }
}
