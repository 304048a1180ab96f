//! What a plugin binary answered when run with `CNI_COMMAND=VERSION`, and the pure decoding
//! of that answer.
//!
//! In: the prober's findings (file checks, exit status, stdout bytes). Out: a
//! [`ProbeOutcome`] that [`super::verdict`] turns into `PluginBinaryMissing` /
//! `PluginBinaryBroken` or accepts.

use serde::Deserialize;

/// The result of looking up and running one plugin binary.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProbeOutcome {
    /// No file of that name in any CNI bin dir.
    Missing {
        /// The bin dirs that were searched, in order.
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
        /// `supportedVersions` from its reply.
        supported: Vec<String>,
    },
}

/// Why an existing plugin file is unusable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Broken {
    /// A directory, FIFO, socket or device.
    NotRegularFile,
    /// No execute permission bit.
    NotExecutable,
    /// Zero bytes: an installer's partial copy.
    Empty,
    /// It could not be started, exited non-zero, or printed a CNI error.
    Failed(String),
    /// It did not exit within the probe timeout and was killed.
    TimedOut {
        /// The timeout, in milliseconds.
        after_ms: u64,
    },
    /// It exited 0 but its stdout is not a CNI VERSION reply.
    BadReply(String),
}

impl std::fmt::Display for Broken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Broken::NotRegularFile => f.write_str("is not a regular file"),
            Broken::NotExecutable => f.write_str("is not executable"),
            Broken::Empty => f.write_str("is empty (a partial copy?)"),
            Broken::Failed(why) => write!(f, "failed on VERSION: {why}"),
            Broken::TimedOut { after_ms } => {
                write!(
                    f,
                    "did not answer VERSION within {after_ms} ms and was killed"
                )
            }
            Broken::BadReply(why) => write!(f, "gave an invalid VERSION reply: {why}"),
        }
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct VersionReply {
    #[serde(default)]
    supported_versions: Option<Vec<String>>,
    #[serde(default)]
    code: Option<u64>,
    #[serde(default)]
    msg: Option<String>,
    #[serde(default)]
    details: Option<String>,
}

/// Decodes a plugin's stdout from `CNI_COMMAND=VERSION`.
///
/// A successful reply is `{"cniVersion": "...", "supportedVersions": [...]}`; a CNI error
/// reply (`{"code": N, "msg": "..."}`) becomes [`Broken::Failed`]; anything else is
/// [`Broken::BadReply`]. Never panics, whatever the bytes.
pub fn decode_version_reply(stdout: &[u8]) -> Result<Vec<String>, Broken> {
    let reply: VersionReply = serde_json::from_slice(stdout).map_err(|e| {
        let shown = String::from_utf8_lossy(&stdout[..stdout.len().min(120)]).into_owned();
        Broken::BadReply(format!("{e} in {shown:?}"))
    })?;
    if let Some(code) = reply.code {
        let mut why = format!("CNI error {code}");
        if let Some(msg) = reply.msg.filter(|m| !m.is_empty()) {
            why.push_str(&format!(": {msg}"));
        }
        if let Some(details) = reply.details.filter(|d| !d.is_empty()) {
            why.push_str(&format!(" ({details})"));
        }
        return Err(Broken::Failed(why));
    }
    match reply.supported_versions {
        Some(v) if !v.is_empty() => Ok(v),
        _ => Err(Broken::BadReply("no supportedVersions".into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn decodes_replies() {
        assert_eq!(
            decode_version_reply(
                br#"{"cniVersion":"1.0.0","supportedVersions":["0.3.1","1.0.0"]}"#
            ),
            Ok(vec!["0.3.1".to_string(), "1.0.0".to_string()])
        );
        assert!(matches!(
            decode_version_reply(br#"{"cniVersion":"1.0.0","code":1,"msg":"incompatible"}"#),
            Err(Broken::Failed(m)) if m.contains("incompatible")
        ));
        assert!(matches!(
            decode_version_reply(b"hello"),
            Err(Broken::BadReply(_))
        ));
        assert!(matches!(
            decode_version_reply(br#"{"cniVersion":"1.0.0"}"#),
            Err(Broken::BadReply(_))
        ));
    }

    proptest! {
        #[test]
        fn never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode_version_reply(&bytes);
        }
    }
}
