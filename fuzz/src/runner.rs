//! The fuzzing loop: replay, mutate, catch panics, flag slow inputs, keep novel inputs.
//!
//! In: a [`Target`] (name, mutator, the function under test), seed inputs, regression inputs,
//! a generator seed and a [`Budget`]. Out: a [`Report`], or a [`Failure`] naming the input
//! that panicked or exceeded the per-input time limit; that input is written to the
//! artifacts directory first. A watchdog thread aborts the process (after writing the input)
//! if one input runs so long that it is a hang, since a hung call cannot be unwound.

use std::collections::HashSet;
use std::io;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::mutate::{Mutator, Rng};

/// One decoder under test.
pub struct Target {
    /// Name: also the corpus, regression and artifact directory name.
    pub name: &'static str,
    /// How its inputs are mutated.
    pub mutator: Mutator,
    /// Runs one input. Returns a signature of the outcome (which error, which verdict, how
    /// many objects): an input with a signature not seen before joins the corpus.
    pub exec: fn(&[u8]) -> u64,
}

/// How much work one target gets.
#[derive(Clone, Copy, Debug)]
pub struct Budget {
    /// Mutated inputs to run at most.
    pub iterations: u64,
    /// Wall time to spend at most (whichever limit comes first).
    pub time: Duration,
    /// One input taking longer than this is a failure (pathological slowness).
    pub slow: Duration,
    /// One input taking longer than this is a hang: the watchdog aborts the process.
    pub hang: Duration,
}

/// Env var: iterations per target (default 200,000; the time limit usually ends it first).
pub const ITERATIONS_ENV: &str = "MESHGATE_FUZZ_ITERATIONS";
/// Env var: seconds per target (default 6).
pub const SECONDS_ENV: &str = "MESHGATE_FUZZ_SECONDS";
/// Env var: the generator seed (default fixed, so runs are reproducible).
pub const SEED_ENV: &str = "MESHGATE_FUZZ_SEED";

impl Budget {
    /// The budget from [`ITERATIONS_ENV`] and [`SECONDS_ENV`], with defaults sized for
    /// `make test` on a 2-core machine (debug build).
    pub fn from_env() -> Self {
        let num = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
        Self {
            iterations: num(ITERATIONS_ENV).unwrap_or(200_000),
            time: Duration::from_secs(num(SECONDS_ENV).unwrap_or(6)),
            slow: Duration::from_secs(2),
            hang: Duration::from_secs(60),
        }
    }
}

/// The generator seed for `target`: [`SEED_ENV`] (or a fixed default) mixed with the name,
/// so targets explore differently but every run repeats exactly.
pub fn seed_for(target: &str) -> u64 {
    let base = std::env::var(SEED_ENV)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0x6d65_7368_6761_7465);
    target.bytes().fold(base, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// What one target's run did.
#[derive(Debug)]
pub struct Report {
    /// Target name.
    pub target: &'static str,
    /// Generator seed used.
    pub seed: u64,
    /// Seed inputs replayed.
    pub seeds: usize,
    /// Regression inputs replayed.
    pub regressions: usize,
    /// Mutated inputs run.
    pub executed: u64,
    /// Distinct outcome signatures seen.
    pub signatures: usize,
    /// Corpus size at the end (seeds plus kept inputs).
    pub corpus: usize,
    /// Wall time.
    pub elapsed: Duration,
    /// The slowest single input.
    pub slowest: Duration,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "fuzz {}: {} inputs in {:.1} s ({:.0}/s) after {} seeds and {} regressions; {} distinct outcomes, corpus {}, slowest input {:.1} ms, seed {}",
            self.target,
            self.executed,
            self.elapsed.as_secs_f64(),
            self.executed as f64 / self.elapsed.as_secs_f64().max(1e-9),
            self.seeds,
            self.regressions,
            self.signatures,
            self.corpus,
            self.slowest.as_secs_f64() * 1e3,
            self.seed,
        )
    }
}

/// Why a run failed.
#[derive(Debug)]
pub enum Failure {
    /// The function under test panicked.
    Panic {
        /// Where the input was written.
        artifact: PathBuf,
        /// The panic message.
        message: String,
        /// The input, hex-encoded (first 512 bytes).
        hex: String,
    },
    /// One input took longer than [`Budget::slow`].
    Slow {
        /// Where the input was written.
        artifact: PathBuf,
        /// How long it took.
        took: Duration,
    },
    /// Seeds or regressions could not be read.
    Io(String),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Panic {
                artifact,
                message,
                hex,
            } => write!(
                f,
                "panicked: {message}\ninput saved to {} (replay it by copying it into fuzz/regressions/<target>/)\nhex: {hex}",
                artifact.display()
            ),
            Failure::Slow { artifact, took } => write!(
                f,
                "one input took {:.2} s; saved to {}",
                took.as_secs_f64(),
                artifact.display()
            ),
            Failure::Io(e) => write!(f, "{e}"),
        }
    }
}

/// The files of `dir`, sorted by name; a missing directory is empty.
pub fn load_dir(dir: &Path) -> io::Result<Vec<(String, Vec<u8>)>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry?;
        if entry.file_type()?.is_file() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') || name == "README.md" {
                continue;
            }
            out.push((name, std::fs::read(entry.path())?));
        }
    }
    out.sort();
    Ok(out)
}

/// Seed directories a target shares with other crates' tests, beside its own
/// `corpus/<target>/` (paths from the fuzz crate's directory): the conflist target's best seeds
/// are the core's golden configs, kept once, in core/testdata.
const SHARED_SEEDS: &[(&str, &str)] = &[("conflist", "../core/testdata")];

/// A target's committed seeds: `corpus/<target>/` and its `SHARED_SEEDS` directories, which
/// must exist.
pub fn load_seeds(target: &str) -> io::Result<Vec<(String, Vec<u8>)>> {
    let dir = crate_dir();
    let mut seeds = load_dir(&dir.join("corpus").join(target))?;
    for (_, shared) in SHARED_SEEDS.iter().filter(|(t, _)| *t == target) {
        let shared = dir.join(shared);
        if !shared.is_dir() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("no seed directory {}", shared.display()),
            ));
        }
        seeds.extend(load_dir(&shared)?);
    }
    Ok(seeds)
}

/// The fuzz crate's directory (corpora, regressions, artifacts live under it).
pub fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().take(512).map(|b| format!("{b:02x}")).collect()
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
    })
}

fn save(dir: &Path, target: &str, input: &[u8]) -> PathBuf {
    let dir = dir.join(target);
    let path = dir.join(format!("crash-{:016x}", fnv(input)));
    let _ = std::fs::create_dir_all(&dir);
    if let Err(e) = std::fs::write(&path, input) {
        eprintln!("cannot write {}: {e}", path.display());
    }
    path
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".into()
    }
}

/// Aborts the process when one input runs longer than `hang` (a hung call cannot be
/// unwound); writes the input first.
struct Watchdog {
    origin: Instant,
    current: Arc<Mutex<Vec<u8>>>,
    started: Arc<AtomicU64>,
    done: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watchdog {
    fn start(target: &'static str, hang: Duration, artifacts: PathBuf) -> Self {
        let current = Arc::new(Mutex::new(Vec::new()));
        let started = Arc::new(AtomicU64::new(0));
        let done = Arc::new(AtomicBool::new(false));
        let origin = Instant::now();
        let (c, s, d) = (current.clone(), started.clone(), done.clone());
        let thread = std::thread::spawn(move || {
            while !d.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(200));
                let at = s.load(Ordering::Relaxed);
                if at == 0 {
                    continue;
                }
                let running = origin.elapsed().saturating_sub(Duration::from_micros(at));
                if running > hang {
                    let input = c.lock().map(|i| i.clone()).unwrap_or_default();
                    let path = save(&artifacts, target, &input);
                    eprintln!(
                        "fuzz {target}: one input has run for {:.0} s: a hang. Input saved to {}; aborting.",
                        running.as_secs_f64(),
                        path.display()
                    );
                    std::process::abort();
                }
            }
        });
        Self {
            origin,
            current,
            started,
            done,
            thread: Some(thread),
        }
    }

    fn enter(&self, input: &[u8]) {
        if let Ok(mut c) = self.current.lock() {
            c.clear();
            c.extend_from_slice(input);
        }
        // +1 so that 0 keeps meaning "idle".
        let at = self.origin.elapsed().as_micros() as u64 + 1;
        self.started.store(at, Ordering::Relaxed);
    }

    fn leave(&self) {
        self.started.store(0, Ordering::Relaxed);
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.done.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Runs `target`: every seed and regression as is, then mutated inputs until the budget is
/// spent. Fails at the first panic or slow input.
pub fn run(
    target: &Target,
    seeds: Vec<Vec<u8>>,
    regressions: Vec<Vec<u8>>,
    rng_seed: u64,
    budget: &Budget,
    artifacts: &Path,
) -> Result<Report, Failure> {
    let begun = Instant::now();
    let watchdog = Watchdog::start(target.name, budget.hang, artifacts.to_path_buf());
    let mut rng = Rng::new(rng_seed);
    let mut signatures: HashSet<u64> = HashSet::new();
    let mut corpus: Vec<Vec<u8>> = Vec::new();
    let mut slowest = Duration::ZERO;
    const MAX_CORPUS: usize = 2048;

    let mut one = |input: &[u8]| -> Result<u64, Failure> {
        watchdog.enter(input);
        let t0 = Instant::now();
        let outcome = catch_unwind(AssertUnwindSafe(|| (target.exec)(input)));
        let took = t0.elapsed();
        watchdog.leave();
        slowest = slowest.max(took);
        match outcome {
            Ok(sig) if took <= budget.slow => Ok(sig),
            Ok(_) => Err(Failure::Slow {
                artifact: save(artifacts, target.name, input),
                took,
            }),
            Err(payload) => Err(Failure::Panic {
                artifact: save(artifacts, target.name, input),
                message: panic_message(payload.as_ref()),
                hex: hex(input),
            }),
        }
    };

    let (n_seeds, n_regressions) = (seeds.len(), regressions.len());
    for input in seeds.into_iter().chain(regressions) {
        let sig = one(&input)?;
        signatures.insert(sig);
        corpus.push(input);
    }
    if corpus.is_empty() {
        corpus.push(Vec::new());
    }

    let mut executed = 0u64;
    while executed < budget.iterations && begun.elapsed() < budget.time {
        let parent = corpus[rng.below(corpus.len())].clone();
        let child = target.mutator.mutate(&mut rng, &parent, &corpus);
        let sig = one(&child)?;
        executed += 1;
        if signatures.insert(sig) {
            if corpus.len() < MAX_CORPUS {
                corpus.push(child);
            } else {
                let i = rng.below(corpus.len());
                corpus[i] = child;
            }
        }
    }
    drop(watchdog);
    Ok(Report {
        target: target.name,
        seed: rng_seed,
        seeds: n_seeds,
        regressions: n_regressions,
        executed,
        signatures: signatures.len(),
        corpus: corpus.len(),
        elapsed: begun.elapsed(),
        slowest,
    })
}

/// Loads `fuzz/corpus/<name>` and `fuzz/regressions/<name>` and runs the target with the
/// environment's budget and seed; artifacts go to `fuzz/artifacts/<name>/`.
pub fn run_committed(target: &Target) -> Result<Report, Failure> {
    let dir = crate_dir();
    let load = |sub: &str| {
        load_dir(&dir.join(sub).join(target.name))
            .map(|v| v.into_iter().map(|(_, b)| b).collect::<Vec<_>>())
            .map_err(|e| Failure::Io(format!("reading {sub}/{}: {e}", target.name)))
    };
    let seeds = load_seeds(target.name)
        .map(|v| v.into_iter().map(|(_, b)| b).collect::<Vec<_>>())
        .map_err(|e| Failure::Io(format!("reading the seeds of {}: {e}", target.name)))?;
    if seeds.is_empty() {
        return Err(Failure::Io(format!(
            "no seeds in fuzz/corpus/{}: the corpus is committed with the crate",
            target.name
        )));
    }
    let regressions = load("regressions")?;
    run(
        target,
        seeds,
        regressions,
        seed_for(target.name),
        &Budget::from_env(),
        &dir.join("artifacts"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn panics_on_magic(input: &[u8]) -> u64 {
        if input.windows(4).any(|w| w == b"BOOM") {
            panic!("found the magic");
        }
        input.len() as u64 % 7
    }

    #[test]
    fn a_panicking_input_is_reported_and_saved() {
        let artifacts = std::env::temp_dir().join(format!("mg-fuzz-test-{}", std::process::id()));
        let target = Target {
            name: "selftest",
            mutator: Mutator {
                dictionary: vec![b"BOOM".to_vec()],
                json: false,
                max_len: 64,
            },
            exec: panics_on_magic,
        };
        let budget = Budget {
            iterations: 100_000,
            time: Duration::from_secs(20),
            slow: Duration::from_secs(5),
            hang: Duration::from_secs(60),
        };
        let got = run(
            &target,
            vec![b"hello".to_vec()],
            vec![],
            1,
            &budget,
            &artifacts,
        );
        match got {
            Err(Failure::Panic {
                artifact, message, ..
            }) => {
                assert_eq!(message, "found the magic");
                let saved = std::fs::read(&artifact).expect("artifact written");
                assert!(saved.windows(4).any(|w| w == b"BOOM"));
            }
            other => panic!("expected a panic failure, got {other:?}"),
        }
        let _ = std::fs::remove_dir_all(&artifacts);
    }

    #[test]
    fn a_clean_target_runs_its_budget() {
        let target = Target {
            name: "clean",
            mutator: Mutator::default(),
            exec: |i| i.len() as u64,
        };
        let budget = Budget {
            iterations: 500,
            time: Duration::from_secs(20),
            slow: Duration::from_secs(5),
            hang: Duration::from_secs(60),
        };
        let r = run(
            &target,
            vec![b"abc".to_vec()],
            vec![b"regression".to_vec()],
            9,
            &budget,
            Path::new("/nonexistent"),
        )
        .expect("no failure");
        assert_eq!((r.executed, r.seeds, r.regressions), (500, 1, 1));
        assert!(r.signatures > 1 && r.corpus > 2, "{r}");
    }

    /// The conflist target's seeds are its own edge cases plus the core's goldens, read from
    /// core/testdata (the one copy), each once.
    #[test]
    fn conflist_seeds_include_the_core_goldens_once() {
        let seeds = load_seeds("conflist").unwrap();
        let names: Vec<&str> = seeds.iter().map(|(n, _)| n.as_str()).collect();
        for golden in [
            "calico-linkerd.conflist",
            "istio-cni.conflist",
            "multus.conf",
        ] {
            assert_eq!(
                names.iter().filter(|n| **n == golden).count(),
                1,
                "{names:?}"
            );
        }
        assert!(names.contains(&"truncated.conflist"), "{names:?}");
        let core = load_dir(&crate_dir().join("../core/testdata")).unwrap();
        assert!(core.iter().all(|g| seeds.contains(g)));
        assert!(
            load_seeds("netlink")
                .unwrap()
                .iter()
                .all(|(n, _)| n.ends_with(".bin"))
        );
    }
}
