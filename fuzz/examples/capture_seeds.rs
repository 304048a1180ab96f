//! Regenerates the netfilter seed corpora from a real kernel (root; needs `ip`, `nft`,
//! `iptables-nft`, `ip6tables-nft`, `iptables-legacy`, `ip6tables-legacy`):
//!
//! ```text
//! cargo run -p meshgate-fuzz --example capture_seeds
//! ```
//!
//! In: nothing. Out: `fuzz/corpus/netlink/*.bin` (the raw buffers the kernel sent for the
//! nf_tables generation, table, chain and rule dumps, each dump alone and all concatenated)
//! and `fuzz/corpus/getsockopt/*.bin` (family byte, table byte, the `ipt_getinfo` answer and
//! the `ipt_get_entries` table blob) for a set of network namespaces holding the rules the
//! meshes really write: linkerd proxy-init through iptables-nft and iptables-legacy (IPv4
//! and IPv6), Istio's native nftables table, and an empty namespace. Each namespace is
//! deleted afterwards.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::Command;

const LINKERD: &str = "
IPT -w -t nat -N PROXY_INIT_REDIRECT
IPT -w -t nat -A PROXY_INIT_REDIRECT -p tcp --match multiport --dports 4190,4191 -j RETURN
IPT -w -t nat -A PROXY_INIT_REDIRECT -p tcp -j REDIRECT --to-port 4143
IPT -w -t nat -A PREROUTING -j PROXY_INIT_REDIRECT
IPT -w -t nat -N PROXY_INIT_OUTPUT
IPT -w -t nat -A PROXY_INIT_OUTPUT -m owner --uid-owner 2102 -j RETURN
IPT -w -t nat -A PROXY_INIT_OUTPUT -o lo -j RETURN
IPT -w -t nat -A PROXY_INIT_OUTPUT -p tcp -m comment --comment proxy-init -j REDIRECT --to-port 4140
IPT -w -t nat -A OUTPUT -j PROXY_INIT_OUTPUT
";

const ISTIO_NFT: &str = "
table inet istio-proxy-nat {
  chain prerouting { type nat hook prerouting priority dstnat; policy accept; meta l4proto tcp jump istio-inbound; }
  chain istio-inbound { tcp dport { 15008, 15090, 15021, 15020 } return; meta l4proto tcp redirect to :15006; }
  chain output { type nat hook output priority -100; policy accept; jump istio-output; }
  chain istio-output { oifname \"lo\" return; meta skuid 1337 return; ip daddr 127.0.0.1 return; ip6 daddr ::1 return; meta l4proto tcp redirect to :15001; }
}
table ip dormant-test { flags dormant; chain c { type nat hook output priority 0; meta l4proto tcp redirect to :1; }; }
";

fn sh(script: &str) -> io::Result<()> {
    let out = Command::new("sh").arg("-ec").arg(script).output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "`{script}` failed: {}",
            String::from_utf8_lossy(&out.stderr)
        )))
    }
}

struct Netns(String);

impl Netns {
    fn new(tag: &str, script: &str) -> io::Result<Self> {
        let name = format!("mgfuzz-{}-{tag}", std::process::id());
        sh(&format!("ip netns add {name}"))?;
        let ns = Netns(name);
        if !script.trim().is_empty() {
            let path = std::env::temp_dir().join(format!("{}.sh", ns.0));
            std::fs::write(&path, script)?;
            sh(&format!("ip netns exec {} sh -e {}", ns.0, path.display()))?;
            let _ = std::fs::remove_file(path);
        }
        Ok(ns)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = sh(&format!("ip netns del {}", self.0));
    }
}

/// Runs `f` on a fresh thread that has entered the namespace (the main thread never moves).
fn in_netns<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> io::Result<T> + Send + 'static,
) -> io::Result<T> {
    let path = PathBuf::from("/run/netns").join(ns);
    std::thread::spawn(move || {
        let file = File::open(&path)?;
        // SAFETY: setns on this thread only, with a valid namespace fd.
        if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(io::Error::last_os_error());
        }
        f()
    })
    .join()
    .map_err(|_| io::Error::other("capture thread panicked"))?
}

fn netlink_socket() -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2).
    let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW, libc::NETLINK_NETFILTER) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh, owned descriptor.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Sends one nf_tables request and returns every buffer received until the dump ends.
fn exchange(fd: &OwnedFd, msg: u16, flags: u16, seq: u32) -> io::Result<Vec<Vec<u8>>> {
    let mut req = [0u8; 20];
    req[0..4].copy_from_slice(&20u32.to_ne_bytes());
    let kind = ((libc::NFNL_SUBSYS_NFTABLES as u16) << 8) | msg;
    req[4..6].copy_from_slice(&kind.to_ne_bytes());
    req[6..8].copy_from_slice(&flags.to_ne_bytes());
    req[8..12].copy_from_slice(&seq.to_ne_bytes());
    // SAFETY: req is valid for its length.
    let sent = unsafe { libc::send(fd.as_raw_fd(), req.as_ptr().cast(), req.len(), 0) };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut out = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // SAFETY: buf is valid for its length.
        let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let chunk = buf[..n as usize].to_vec();
        // The last message of the buffer: DONE ends a dump, ERROR (an ack) ends a request.
        let mut finished = false;
        let mut rest = &chunk[..];
        while rest.len() >= 16 {
            let len = u32::from_ne_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
            let ty = u16::from_ne_bytes([rest[4], rest[5]]);
            if ty == libc::NLMSG_DONE as u16 || ty == libc::NLMSG_ERROR as u16 {
                finished = true;
            }
            if len < 16 || len > rest.len() {
                break;
            }
            rest = &rest[len.next_multiple_of(4).min(rest.len())..];
        }
        out.push(chunk);
        if finished {
            return Ok(out);
        }
    }
}

/// The raw dumps: generation, tables, chains, rules.
fn nft_dumps() -> io::Result<Vec<(&'static str, Vec<u8>)>> {
    let fd = netlink_socket()?;
    let (req, dump, ack) = (
        libc::NLM_F_REQUEST as u16,
        libc::NLM_F_DUMP as u16,
        libc::NLM_F_ACK as u16,
    );
    let mut out = Vec::new();
    for (i, (what, msg, flags)) in [
        ("gen", libc::NFT_MSG_GETGEN as u16, req | ack),
        ("tables", libc::NFT_MSG_GETTABLE as u16, req | dump),
        ("chains", libc::NFT_MSG_GETCHAIN as u16, req | dump),
        ("rules", libc::NFT_MSG_GETRULE as u16, req | dump),
    ]
    .into_iter()
    .enumerate()
    {
        let bufs = exchange(&fd, msg, flags, i as u32 + 1)?;
        out.push((what, bufs.concat()));
    }
    Ok(out)
}

fn getsockopt(
    fd: &OwnedFd,
    level: libc::c_int,
    opt: libc::c_int,
    buf: &mut [u8],
) -> io::Result<()> {
    let mut len = buf.len() as libc::socklen_t;
    // SAFETY: buf is valid for len bytes.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            level,
            opt,
            buf.as_mut_ptr().cast(),
            &mut len,
        )
    };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// `[family][table][ipt_getinfo][entries blob]` for the nat table of each family.
fn legacy_tables() -> io::Result<Vec<(&'static str, Vec<u8>)>> {
    let mut out = Vec::new();
    for (fam_byte, what, domain, level) in [
        (0u8, "ip", libc::AF_INET, libc::IPPROTO_IP),
        (1u8, "ip6", libc::AF_INET6, libc::IPPROTO_IPV6),
    ] {
        // SAFETY: plain socket(2).
        let raw = unsafe { libc::socket(domain, libc::SOCK_RAW, libc::IPPROTO_RAW) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: raw is a fresh, owned descriptor.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let mut info = [0u8; 84];
        info[..3].copy_from_slice(b"nat");
        getsockopt(&fd, level, 64, &mut info)?;
        let size = u32::from_ne_bytes([info[80], info[81], info[82], info[83]]) as usize;
        let mut entries = vec![0u8; 40 + size];
        entries[..3].copy_from_slice(b"nat");
        entries[32..36].copy_from_slice(&(size as u32).to_ne_bytes());
        getsockopt(&fd, level, 65, &mut entries)?;
        let mut seed = vec![fam_byte, 0];
        seed.extend_from_slice(&info);
        seed.extend_from_slice(&entries[40..]);
        out.push((what, seed));
    }
    Ok(out)
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join(name), bytes)?;
    println!("{}/{name}: {} bytes", dir.display(), bytes.len());
    Ok(())
}

fn main() -> io::Result<()> {
    let corpus = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("corpus");
    let nft = |ipt: &str| LINKERD.replace("IPT", ipt);
    let scenarios = [
        ("empty", String::new()),
        (
            "linkerd-iptables-nft",
            format!("{}\n{}", nft("iptables-nft"), nft("ip6tables-nft")),
        ),
        (
            "istio-nft",
            format!(
                "cat > /tmp/mgfuzz-istio.nft <<'EOF'\n{ISTIO_NFT}\nEOF\nnft -f /tmp/mgfuzz-istio.nft"
            ),
        ),
    ];
    for (tag, script) in scenarios {
        let ns = Netns::new(tag, &script)?;
        let dumps = in_netns(&ns.0, nft_dumps)?;
        let mut all = Vec::new();
        for (what, bytes) in &dumps {
            write(&corpus.join("netlink"), &format!("{tag}-{what}.bin"), bytes)?;
            all.extend_from_slice(bytes);
        }
        write(&corpus.join("netlink"), &format!("{tag}-all.bin"), &all)?;
    }
    let legacy = format!("{}\n{}", nft("iptables-legacy"), nft("ip6tables-legacy"));
    let ns = Netns::new("linkerd-legacy", &legacy)?;
    for (what, bytes) in in_netns(&ns.0, legacy_tables)? {
        write(
            &corpus.join("getsockopt"),
            &format!("linkerd-legacy-{what}-nat.bin"),
            &bytes,
        )?;
    }
    let empty = Netns::new(
        "legacy-empty",
        "iptables-legacy -t nat -L >/dev/null\nip6tables-legacy -t nat -L >/dev/null",
    )?;
    for (what, bytes) in in_netns(&empty.0, legacy_tables)? {
        write(
            &corpus.join("getsockopt"),
            &format!("empty-legacy-{what}-nat.bin"),
            &bytes,
        )?;
    }
    Ok(())
}
