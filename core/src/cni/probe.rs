//! What a plugin binary answered when run with `CNI_COMMAND=VERSION`, and the pure decoding
//! of that answer exactly as libcni v1.3 decodes it (`pkg/invoke/exec.go` `GetVersionInfo`,
//! `pkg/invoke/raw_exec.go` `pluginErr`, `pkg/version/plugin.go` `PluginDecoder.Decode`).
//!
//! In: the prober's findings (file checks, exit status, stdout bytes). Out: a
//! [`ProbeOutcome`] that [`super::verdict`] turns into `PluginBinaryMissing` /
//! `PluginBinaryBroken` or accepts. Nothing here keeps or prints a byte of the plugin's
//! output: a reply is summarised by its length and what was wrong with it.

use super::gojson::{self, GoValue, JsonError};

/// The stdin libcni sends to VERSION: `{"cniVersion":"<version.Current()>"}`, never the
/// config's own version (libcni v1.3 `GetVersionInfo`).
pub const VERSION_STDIN: &[u8] = br#"{"cniVersion":"1.1.0"}"#;

/// The error message after which libcni treats a plugin as supporting only 0.1.0.
pub const UNKNOWN_VERSION_COMMAND: &str = "unknown CNI_COMMAND: VERSION";

/// True when `plugin_type` is a plain file name, the only kind libcni's `FindInPath` looks
/// up since CVE-2021-20206 (no path separator), and not `.`/`..` (which name directories,
/// never a regular file) or a NUL byte (which no path can hold). `type` and `ipam.type`
/// are both checked with it before anything is looked up or run.
pub fn is_plain_name(plugin_type: &str) -> bool {
    !plugin_type.is_empty()
        && plugin_type != "."
        && plugin_type != ".."
        && !plugin_type.contains(['/', '\0'])
}

/// The result of looking up and running one plugin binary.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProbeOutcome {
    /// No regular file of that name in any CNI bin dir.
    Missing {
        /// The bin dirs that were searched, in order (from the agent's flags).
        searched: Vec<String>,
    },
    /// A file of that name exists but is not a usable plugin.
    Broken {
        /// The file that was found (the first match in bin-dir order, as libcni's FindInPath).
        path: String,
        /// Why it is unusable.
        why: Broken,
    },
    /// The binary answered VERSION with these supported versions.
    Answered {
        /// The binary that answered.
        path: String,
        /// The supported versions, as libcni's decoder reports them.
        supported: Vec<String>,
    },
}

/// Why an existing plugin file is unusable. Every variant's text is free of plugin output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Broken {
    /// A directory, FIFO, socket or device.
    NotRegularFile,
    /// No execute permission bit.
    NotExecutable,
    /// Zero bytes: an installer's partial copy.
    Empty,
    /// It could not be started (the OS error).
    CannotStart(String),
    /// It exited unsuccessfully.
    Failed {
        /// The exit status, as the OS reports it.
        status: String,
        /// The CNI error code it printed, if its stdout was a CNI error object.
        cni_code: Option<u64>,
        /// Bytes it wrote to stdout and stderr.
        stdout_len: usize,
        /// Bytes it wrote to stderr.
        stderr_len: usize,
    },
    /// It did not finish before the deadline and was killed with everything it started
    /// (`after_ms` 0: it was not run at all, the verification's deadline had passed).
    TimedOut {
        /// The time it was given, in milliseconds.
        after_ms: u64,
    },
    /// It exited, but a process it started kept its stdout or stderr open until the
    /// deadline: libcni's exec (Go's `cmd.Run`) would still be waiting for EOF.
    HeldOutput {
        /// The time it was given, in milliseconds.
        after_ms: u64,
    },
    /// It exited 0 but its stdout is not a VERSION reply libcni accepts.
    BadReply {
        /// What is wrong with it.
        why: ReplyError,
        /// Its length in bytes.
        len: usize,
    },
}

/// Why a VERSION reply is rejected by libcni's `PluginDecoder.Decode`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReplyError {
    /// Not JSON.
    #[error("{0}")]
    Json(#[from] JsonError),
    /// JSON, but a field has the wrong type.
    #[error("field {0:?} has the wrong JSON type")]
    FieldType(&'static str),
    /// No (or an empty) `cniVersion`: "decoding version info: missing field cniVersion".
    #[error("it has no cniVersion")]
    NoCniVersion,
    /// No `supportedVersions` and a `cniVersion` other than 0.2.0.
    #[error("it has no supportedVersions")]
    NoSupportedVersions,
}

impl Broken {
    /// The failure says nothing lasting about the binary: it ran out of time, kept its
    /// output open, or could not be started at all (`ETXTBSY` while an installer rewrites it
    /// in place, a failed fork, thread or pipe). The same binary may answer on the next run.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            Broken::TimedOut { .. } | Broken::HeldOutput { .. } | Broken::CannotStart(_)
        )
    }
}

impl std::fmt::Display for Broken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Broken::NotRegularFile => f.write_str("is not a regular file"),
            Broken::NotExecutable => f.write_str("is not executable"),
            Broken::Empty => f.write_str("is empty (a partial copy?)"),
            Broken::CannotStart(why) => write!(f, "cannot be executed: {why}"),
            Broken::Failed {
                status,
                cni_code,
                stdout_len,
                stderr_len,
            } => {
                write!(f, "failed on VERSION ({status}")?;
                if let Some(code) = cni_code {
                    write!(f, ", CNI error code {code}")?;
                }
                write!(f, "; {stdout_len} bytes on stdout, {stderr_len} on stderr)")
            }
            Broken::TimedOut { after_ms: 0 } => {
                f.write_str("was not run: the verification's overall deadline had already passed")
            }
            Broken::TimedOut { after_ms } => write!(
                f,
                "did not answer VERSION within {after_ms} ms and was killed with everything it started"
            ),
            Broken::HeldOutput { after_ms } => write!(
                f,
                "exited, but a process it started kept its output open past {after_ms} ms (libcni waits for that output to end); all were killed"
            ),
            Broken::BadReply { why, len } => {
                write!(f, "gave an invalid VERSION reply ({len} bytes): {why}")
            }
        }
    }
}

fn string_field(v: &GoValue, slot: &mut String, name: &'static str) -> Result<(), ReplyError> {
    match v {
        GoValue::String(s) => {
            *slot = s.clone();
            Ok(())
        }
        GoValue::Null => Ok(()),
        _ => Err(ReplyError::FieldType(name)),
    }
}

fn members<'a>(v: &'a GoValue, name: &'static str) -> Result<&'a [(String, GoValue)], ReplyError> {
    match v {
        GoValue::Object(m) => Ok(m),
        GoValue::Null => Ok(&[]),
        _ => Err(ReplyError::FieldType(name)),
    }
}

/// Field lookup with Go's rules: exact names first, then case-folded.
fn pick(key: &str, fields: &[&'static str]) -> Option<&'static str> {
    fields
        .iter()
        .find(|f| **f == key)
        .or_else(|| fields.iter().find(|f| gojson::field_matches(key, f)))
        .copied()
}

/// Decodes a plugin's stdout from a successful `CNI_COMMAND=VERSION` (libcni
/// `PluginDecoder.Decode`): typed `{cniVersion string, supportedVersions []string}`; an
/// empty `cniVersion` is rejected; no `supportedVersions` is accepted only with cniVersion
/// "0.2.0", meaning 0.1.0 and 0.2.0. Never panics, whatever the bytes.
pub fn decode_version_reply(stdout: &[u8]) -> Result<Vec<String>, ReplyError> {
    let v = gojson::parse(stdout)?;
    let mut cni_version = String::new();
    let mut supported: Vec<String> = Vec::new();
    let mut first_err = None;
    for (k, x) in members(&v, "(the reply)")? {
        let r = match pick(k, &["cniVersion", "supportedVersions"]) {
            Some("cniVersion") => string_field(x, &mut cni_version, "cniVersion"),
            Some(_) => match x {
                GoValue::Null => {
                    supported.clear();
                    Ok(())
                }
                GoValue::Array(items) => {
                    supported.clear();
                    let mut r = Ok(());
                    for item in items {
                        let mut s = String::new();
                        if string_field(item, &mut s, "supportedVersions").is_err() {
                            r = Err(ReplyError::FieldType("supportedVersions"));
                        }
                        supported.push(s);
                    }
                    r
                }
                _ => Err(ReplyError::FieldType("supportedVersions")),
            },
            None => Ok(()),
        };
        if let Err(e) = r {
            first_err.get_or_insert(e);
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    if cni_version.is_empty() {
        return Err(ReplyError::NoCniVersion);
    }
    if supported.is_empty() {
        if cni_version == "0.2.0" {
            return Ok(vec!["0.1.0".into(), "0.2.0".into()]);
        }
        return Err(ReplyError::NoSupportedVersions);
    }
    Ok(supported)
}

/// What libcni's `pluginErr` makes of a failed plugin's stdout: `Some((code, msg))` when it
/// is non-empty and decodes into `types.Error{Code uint; Msg, Details string}`.
pub fn decode_error_reply(stdout: &[u8]) -> Option<(u64, String)> {
    if stdout.is_empty() {
        return None;
    }
    let v = gojson::parse(stdout).ok()?;
    let (mut code, mut msg) = (0u64, String::new());
    for (k, x) in members(&v, "").ok()? {
        match pick(k, &["code", "msg", "details"]) {
            Some("code") => match x {
                GoValue::Null => {}
                // Go's uint decoding: strconv.ParseUint, base 10, no sign, no fraction.
                GoValue::Number(n) => code = n.parse::<u64>().ok()?,
                _ => return None,
            },
            Some("msg") => string_field(x, &mut msg, "msg").ok()?,
            Some(_) => string_field(x, &mut String::new(), "details").ok()?,
            None => {}
        }
    }
    Some((code, msg))
}

/// libcni `GetVersionInfo` after a failed run: a plugin whose error message is exactly
/// "unknown CNI_COMMAND: VERSION" is taken to support only 0.1.0.
pub fn is_unknown_version_command(stdout: &[u8]) -> bool {
    decode_error_reply(stdout).is_some_and(|(_, msg)| msg == UNKNOWN_VERSION_COMMAND)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn decodes_replies_like_libcni() {
        assert_eq!(
            decode_version_reply(
                br#"{"cniVersion":"1.0.0","supportedVersions":["0.3.1","1.0.0"]}"#
            ),
            Ok(vec!["0.3.1".to_string(), "1.0.0".to_string()])
        );
        // A reply without cniVersion is rejected, even with supportedVersions.
        assert_eq!(
            decode_version_reply(br#"{"supportedVersions":["0.3.1"]}"#),
            Err(ReplyError::NoCniVersion)
        );
        // A bare 0.2.0 reply supports 0.1.0 and 0.2.0; any other bare one is rejected.
        assert_eq!(
            decode_version_reply(br#"{"cniVersion":"0.2.0"}"#),
            Ok(vec!["0.1.0".to_string(), "0.2.0".to_string()])
        );
        assert_eq!(
            decode_version_reply(br#"{"cniVersion":"1.0.0"}"#),
            Err(ReplyError::NoSupportedVersions)
        );
        // Go's case-insensitive field names.
        assert_eq!(
            decode_version_reply(br#"{"CNIVersion":"1.0.0","SupportedVersions":["1.0.0"]}"#),
            Ok(vec!["1.0.0".to_string()])
        );
        assert!(matches!(
            decode_version_reply(b"hello"),
            Err(ReplyError::Json(_))
        ));
        assert_eq!(
            decode_version_reply(br#"{"cniVersion":1}"#),
            Err(ReplyError::FieldType("cniVersion"))
        );
    }

    #[test]
    fn unknown_version_command_is_recognised() {
        assert!(is_unknown_version_command(
            br#"{"code":4,"msg":"unknown CNI_COMMAND: VERSION"}"#
        ));
        assert!(!is_unknown_version_command(
            br#"{"code":-1,"msg":"unknown CNI_COMMAND: VERSION"}"#
        ));
        assert!(!is_unknown_version_command(b""));
        assert_eq!(
            decode_error_reply(br#"{"code":7,"msg":"incompatible CNI versions"}"#),
            Some((7, "incompatible CNI versions".into()))
        );
    }

    #[test]
    fn messages_never_quote_the_reply() {
        let secret = br#"{"code":1,"msg":"SECRET-TOKEN"} trailing"#;
        let why = decode_version_reply(secret).unwrap_err();
        let shown = Broken::BadReply {
            why,
            len: secret.len(),
        }
        .to_string();
        assert!(!shown.contains("SECRET"), "{shown}");
    }

    proptest! {
        #[test]
        fn never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode_version_reply(&bytes);
            let _ = decode_error_reply(&bytes);
        }
    }
}
