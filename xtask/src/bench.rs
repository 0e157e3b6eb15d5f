//! `cargo xtask bench`: the CLI's transport and failover benchmarks and the demo, then the CPU
//! comparison with diffusers (`docs/benchmarks.md`).
//!
//! The comparison runs, for each case (model geometry, task, input size), dtype and thread
//! count, first diffusers (`scripts/bench_diffusers.py`: one fresh worker process per memory
//! layout, NCHW and channels-last) and then ours (`vae-parallel bench decode|encode`, a fresh
//! process), on the same model directory and the same `.npy` input. Every result (or failure)
//! is appended as one JSON line to `target/bench-results/<timestamp>.jsonl` as it comes, with a
//! `"config"` object naming its configuration; at the end one table compares ours with the
//! faster diffusers layout. `--tabulate FILE` prints the table of such a file again. A
//! configuration that fails (on either side) shows as `n/a` with its error's first line and
//! the others still run.

use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, bail};
use serde_json::{Value, json};

/// The comparison's script, relative to the repository root.
const BENCH_SCRIPT: &str = "scripts/bench_diffusers.py";

/// The Python tried when neither `--python` nor `$VAE_FIXTURES_PYTHON` names one.
const DEFAULT_BENCH_PYTHON: &str = "/work/venv-fixtures/bin/python";

/// Where the raw results go, relative to the repository root.
const RESULTS_DIR: &str = "target/bench-results";

/// The release binary, relative to the repository root.
const EXE: &str = "target/release/vae-parallel";

/// The CPU flags the table's header reports (present or absent), in this order.
const SIMD_FLAGS: [&str; 7] = ["avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16", "amx_tile"];

/// The diffusers layouts.
const LAYOUTS: [&str; 2] = ["nchw", "channels_last"];

/// The dtypes both sides are asked for.
const DTYPES: [&str; 2] = ["f32", "bf16"];

/// What a case times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Task {
    Decode,
    Encode,
}

impl Task {
    fn name(self) -> &'static str {
        match self {
            Task::Decode => "decode",
            Task::Encode => "encode",
        }
    }
}

/// One model geometry, task and input size.
#[derive(Debug)]
struct Case {
    /// `--cases` name.
    name: &'static str,
    /// `bench_diffusers.py --family`.
    family: &'static str,
    task: Task,
    /// Image size in pixels (output of a decode, input of an encode).
    size: u32,
    /// For the table's legend.
    what: &'static str,
}

impl Case {
    /// The model directory, relative to the repository root (`bench_diffusers.py`'s default).
    fn model_dir(&self) -> String {
        format!("target/bench-models/{}_geometry", self.family)
    }

    /// The input `.npy` both sides read.
    fn input(&self) -> String {
        let stem = match self.task {
            Task::Decode => "z",
            Task::Encode => "x",
        };
        format!("{}/{stem}_{}.npy", self.model_dir(), self.size)
    }
}

/// Every case, in the table's order.
const CASES: [Case; 7] = [
    Case {
        name: "flux1-256",
        family: "flux1",
        task: Task::Decode,
        size: 256,
        what: "AutoencoderKL, FLUX.1/Z-Image geometry (16 latent ch, no quant convs), decode [1,16,32,32] → 256²",
    },
    Case {
        name: "flux1-512",
        family: "flux1",
        task: Task::Decode,
        size: 512,
        what: "AutoencoderKL, FLUX.1/Z-Image geometry, decode [1,16,64,64] → 512²",
    },
    Case {
        name: "sd-256",
        family: "sd",
        task: Task::Decode,
        size: 256,
        what: "AutoencoderKL, SD geometry (4 latent ch, quant convs), decode [1,4,32,32] → 256²",
    },
    Case {
        name: "sd-512",
        family: "sd",
        task: Task::Decode,
        size: 512,
        what: "AutoencoderKL, SD geometry, decode [1,4,64,64] → 512²",
    },
    Case {
        name: "wan21-9x256",
        family: "wan21",
        task: Task::Decode,
        size: 256,
        what: "AutoencoderKLWan, Wan2.1 geometry, decode [1,16,3,32,32] → 9 frames of 256²",
    },
    Case {
        name: "flux1-enc-512",
        family: "flux1",
        task: Task::Encode,
        size: 512,
        what: "AutoencoderKL, FLUX.1/Z-Image geometry, encode [1,3,512,512] → mean [1,16,64,64]",
    },
    Case {
        name: "wan21-enc-9x256",
        family: "wan21",
        task: Task::Encode,
        size: 256,
        what: "AutoencoderKLWan, Wan2.1 geometry, encode [1,3,9,256,256] → mean [1,16,3,32,32]",
    },
];

const USAGE: &str = "usage: cargo xtask bench [--decode-only | --no-decode] [--cases a,b,..] [--threads 1,2] \
                     [--iters N] [--dtypes f32,bf16] [--layouts nchw,channels_last] [--python PATH] \
                     | cargo xtask bench --tabulate FILE.jsonl";

/// The options of `cargo xtask bench`.
#[derive(Debug)]
struct Options {
    python: Option<String>,
    iters: usize,
    transport: bool,
    compare: bool,
    cases: Vec<&'static Case>,
    threads: Vec<usize>,
    dtypes: Vec<String>,
    layouts: Vec<String>,
    tabulate: Option<PathBuf>,
}

/// The comma-separated items of `value`, each one of `allowed`.
fn list<'a>(flag: &str, value: &str, allowed: &[&'a str]) -> anyhow::Result<Vec<&'a str>> {
    let items: Vec<&str> = value.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
    anyhow::ensure!(!items.is_empty(), "{flag} needs at least one value");
    items
        .into_iter()
        .map(|item| {
            allowed
                .iter()
                .find(|a| **a == item)
                .copied()
                .with_context(|| format!("{flag}: {item:?} is not one of {}", allowed.join(", ")))
        })
        .collect()
}

fn parse_options(mut args: impl Iterator<Item = String>) -> anyhow::Result<Options> {
    let mut o = Options {
        python: None,
        iters: 3,
        transport: true,
        compare: true,
        cases: CASES.iter().collect(),
        threads: vec![1, 2],
        dtypes: DTYPES.iter().map(|d| d.to_string()).collect(),
        layouts: LAYOUTS.iter().map(|l| l.to_string()).collect(),
        tabulate: None,
    };
    let names: Vec<&str> = CASES.iter().map(|c| c.name).collect();
    while let Some(arg) = args.next() {
        let mut value = || args.next().with_context(|| format!("{arg} needs a value\n{USAGE}"));
        match arg.as_str() {
            "--python" => o.python = Some(value()?),
            "--iters" => {
                o.iters = value()?.parse().context("--iters")?;
                anyhow::ensure!(o.iters >= 1, "--iters must be at least 1");
            }
            "--decode-only" => o.transport = false,
            "--no-decode" => o.compare = false,
            "--cases" => {
                let chosen = list("--cases", &value()?, &names)?;
                o.cases = chosen.iter().filter_map(|n| CASES.iter().find(|c| c.name == *n)).collect();
            }
            "--threads" => {
                o.threads = value()?
                    .split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(|t| t.parse::<usize>().ok().filter(|t| *t >= 1).with_context(|| format!("--threads {t:?}")))
                    .collect::<anyhow::Result<_>>()?;
                anyhow::ensure!(!o.threads.is_empty(), "--threads needs at least one count");
            }
            "--dtypes" => o.dtypes = list("--dtypes", &value()?, &DTYPES)?.into_iter().map(String::from).collect(),
            "--layouts" => o.layouts = list("--layouts", &value()?, &LAYOUTS)?.into_iter().map(String::from).collect(),
            "--tabulate" => o.tabulate = Some(PathBuf::from(value()?)),
            other => bail!("unknown argument {other:?} to bench\n{USAGE}"),
        }
    }
    Ok(o)
}

/// `cargo xtask bench`: the transport and failover benchmarks and the demo, then the
/// comparison with diffusers, in release mode (or `--tabulate FILE`: that file's table).
pub(crate) fn bench(args: impl Iterator<Item = String>) -> anyhow::Result<()> {
    let args: Vec<String> = args.collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        let names: Vec<&str> = CASES.iter().map(|c| c.name).collect();
        println!("{USAGE}\ncases: {}", names.join(", "));
        return Ok(());
    }
    let o = parse_options(args.into_iter())?;
    let root = crate::repo_root();
    std::env::set_current_dir(&root).with_context(|| format!("entering {}", root.display()))?;
    if let Some(file) = &o.tabulate {
        let text = std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        let records = text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).with_context(|| format!("{}: not JSON: {l}", file.display())))
            .collect::<anyhow::Result<Vec<Value>>>()?;
        print!("{}", render(&records));
        return Ok(());
    }
    crate::cargo(&["build", "--release", "-p", "vae-parallel"])?;
    if o.transport {
        transport_benches(EXE)?;
    }
    if o.compare {
        comparison(&o)?;
    }
    Ok(())
}

/// The transport and failover benchmarks and the demo.
fn transport_benches(exe: &str) -> anyhow::Result<()> {
    for (transport, ranks) in [("socket", "2"), ("socket", "4"), ("local", "4")] {
        crate::run(
            exe,
            &["bench", "transport", "--transport", transport, "--ranks", ranks, "--mib", "32", "--iters", "5"],
        )?;
    }
    for transport in ["socket", "local"] {
        crate::run(exe, &["bench", "failover", "--transport", transport, "--ranks", "4"])?;
    }
    crate::run(exe, &["demo", "--ranks", "4", "--work-ms", "20"])
}

/// What a child process left.
struct Captured {
    stdout: String,
    stderr: String,
    success: bool,
    status: String,
}

/// Runs `cmd`, echoing it, its stderr (live) and its stdout to our stderr, and returns both
/// streams; a failure to start is an error, a failing exit is not.
fn capture(cmd: &mut Command) -> anyhow::Result<Captured> {
    eprintln!("$ {cmd:?}");
    let mut child =
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().with_context(|| format!("starting {cmd:?}"))?;
    let err = child.stderr.take().context("no stderr pipe")?;
    let echo = std::thread::spawn(move || {
        let mut kept = String::new();
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            eprintln!("{line}");
            kept.push_str(&line);
            kept.push('\n');
        }
        kept
    });
    let mut stdout = String::new();
    child.stdout.take().context("no stdout pipe")?.read_to_string(&mut stdout).context("reading stdout")?;
    let status = child.wait().context("waiting for the child")?;
    let stderr = echo.join().unwrap_or_default();
    eprint!("{stdout}"); // the raw JSON lines
    Ok(Captured { stdout, stderr, success: status.success(), status: status.to_string() })
}

/// The first line of a failed command's error: the CLI's `error: …` line (without the prefix),
/// else the last line of a Python traceback, else the first line of stderr, else the status.
fn first_error_line(stderr: &str, status: &str) -> String {
    let lines: Vec<&str> = stderr.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    if let Some(l) = lines.iter().find_map(|l| l.strip_prefix("error: ")) {
        return l.to_string();
    }
    if lines.iter().any(|l| l.starts_with("Traceback")) {
        return lines.last().map_or_else(String::new, |l| l.to_string());
    }
    lines.first().map_or_else(|| format!("exited with {status}"), |l| l.to_string())
}

/// The JSON object lines of `stdout`.
fn json_lines(stdout: &str) -> Vec<Value> {
    stdout.lines().filter(|l| l.trim_start().starts_with('{')).filter_map(|l| serde_json::from_str(l).ok()).collect()
}

/// The Python for the comparison, or why there is none.
fn bench_python(explicit: Option<String>) -> Result<String, String> {
    if let Some(p) = explicit.or_else(|| std::env::var(crate::FIXTURE_PYTHON_ENV).ok().filter(|p| !p.is_empty())) {
        return Ok(p);
    }
    if Path::new(DEFAULT_BENCH_PYTHON).exists() {
        return Ok(DEFAULT_BENCH_PYTHON.into());
    }
    Err(format!(
        "no Python with diffusers: pass --python or set ${} (none at {DEFAULT_BENCH_PYTHON})",
        crate::FIXTURE_PYTHON_ENV
    ))
}

/// The CPU's model name, logical CPU count and the [`SIMD_FLAGS`] it has, from `/proc/cpuinfo`.
fn cpu_info(cpuinfo: &str) -> Value {
    let field = |key: &str| {
        cpuinfo.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == key).then(|| v.trim().to_string())
        })
    };
    let flags = field("flags").unwrap_or_default();
    let have: Vec<&str> = flags.split_whitespace().collect();
    let logical = cpuinfo.lines().filter(|l| l.split(':').next().is_some_and(|k| k.trim() == "processor")).count();
    json!({
        "cpu": field("model name").unwrap_or_else(|| "unknown CPU".into()),
        "logical_cpus": logical,
        "simd": SIMD_FLAGS.iter().filter(|f| have.contains(f)).collect::<Vec<_>>(),
        "simd_absent": SIMD_FLAGS.iter().filter(|f| !have.contains(f)).collect::<Vec<_>>(),
    })
}

/// A UTC timestamp `YYYYMMDDTHHMMSSZ` of `secs` since the Unix epoch.
fn utc_stamp(secs: u64) -> String {
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Howard Hinnant's civil_from_days.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}{month:02}{day:02}T{:02}{:02}{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// The machine record: CPU, torch / diffusers versions, the commit, the options.
fn machine_record(python: &str, o: &Options) -> Value {
    let mut record = cpu_info(&std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default());
    const VERSIONS: &str = "import json, torch, diffusers; print(json.dumps({'torch': torch.__version__, \
                            'diffusers': diffusers.__version__, 'cpu_capability': torch.backends.cpu.get_cpu_capability()}))";
    let versions = Command::new(python)
        .args(["-c", VERSIONS])
        .output()
        .ok()
        .and_then(|o| json_lines(&String::from_utf8_lossy(&o.stdout)).pop());
    let git = Command::new("git")
        .args(["describe", "--always", "--dirty"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    let m = record.as_object_mut().expect("cpu_info is an object");
    m.insert("kind".into(), "machine".into());
    if let Some(Value::Object(v)) = versions {
        m.extend(v);
    }
    m.insert("git".into(), git.map_or(Value::Null, Value::String));
    m.insert("iters".into(), o.iters.into());
    m.insert("python".into(), python.into());
    m.insert(
        "cases".into(),
        o.cases.iter().map(|c| json!({"name": c.name, "what": c.what})).collect::<Vec<_>>().into(),
    );
    record
}

/// Appends records to the JSON-lines file, one line each, flushed.
struct Results {
    path: PathBuf,
    file: std::fs::File,
    records: Vec<Value>,
}

impl Results {
    fn create() -> anyhow::Result<Self> {
        std::fs::create_dir_all(RESULTS_DIR).with_context(|| format!("creating {RESULTS_DIR}"))?;
        let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let path = PathBuf::from(format!("{RESULTS_DIR}/{}.jsonl", utc_stamp(secs)));
        let file = std::fs::OpenOptions::new()
            .create_new(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("creating {}", path.display()))?;
        Ok(Self { path, file, records: Vec::new() })
    }

    fn push(&mut self, record: Value) -> anyhow::Result<()> {
        writeln!(self.file, "{record}")
            .and_then(|()| self.file.flush())
            .with_context(|| format!("writing {}", self.path.display()))?;
        self.records.push(record);
        Ok(())
    }
}

/// `record` with the configuration that produced it.
fn with_config(mut record: Value, case: &Case, dtype: &str, threads: usize, layout: Option<&str>) -> Value {
    let config = json!({
        "case": case.name,
        "task": case.task.name(),
        "dtype": dtype,
        "threads": threads,
        "layout": layout,
    });
    if let Some(m) = record.as_object_mut() {
        m.insert("config".into(), config);
        record
    } else {
        json!({"config": config, "raw": record})
    }
}

/// A failure record for one side of one configuration.
fn failure(case: &Case, side: &str, error: &str) -> Value {
    json!({"kind": case.task.name(), "impl": side, "error": error})
}

/// Prepares the models and inputs, then runs every configuration (diffusers, then ours), and
/// prints the table.
fn comparison(o: &Options) -> anyhow::Result<()> {
    let python = match bench_python(o.python.clone()) {
        Ok(p) => p,
        Err(why) => {
            eprintln!("skipping the comparison with diffusers: {why}");
            return Ok(());
        }
    };
    if let Err(err) = crate::check_fixture_python(&python, &crate::repo_root()) {
        eprintln!("skipping the comparison with diffusers: {err:#}");
        return Ok(());
    }
    let mut results = Results::create()?;
    eprintln!("raw results go to {}", results.path.display());
    results.push(machine_record(&python, o))?;

    // Models and inputs, once per (family, task): a case whose preparation failed fails whole.
    let mut unprepared: Vec<(&str, String)> = Vec::new();
    let mut groups: Vec<(&str, Task, Vec<u32>)> = Vec::new();
    for case in &o.cases {
        match groups.iter_mut().find(|(f, t, _)| *f == case.family && *t == case.task) {
            Some((_, _, sizes)) if !sizes.contains(&case.size) => sizes.push(case.size),
            Some(_) => {}
            None => groups.push((case.family, case.task, vec![case.size])),
        }
    }
    for (family, task, sizes) in &groups {
        let sizes = sizes.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
        let got = capture(Command::new(&python).args([
            BENCH_SCRIPT,
            "--family",
            family,
            "--task",
            task.name(),
            "--sizes",
            &sizes,
            "--prepare-only",
        ]))?;
        if !got.success {
            let why = format!("preparing the model failed: {}", first_error_line(&got.stderr, &got.status));
            for case in o.cases.iter().filter(|c| c.family == *family && c.task == *task) {
                unprepared.push((case.name, why.clone()));
            }
        }
    }

    let iters = o.iters.to_string();
    let layouts = o.layouts.join(",");
    let total = o.cases.len() * o.dtypes.len() * o.threads.len();
    let mut n = 0;
    for case in &o.cases {
        for dtype in &o.dtypes {
            for &threads in &o.threads {
                n += 1;
                eprintln!("== [{n}/{total}] {} {dtype}, {threads} thread(s)", case.name);
                let t = threads.to_string();
                if let Some((_, why)) = unprepared.iter().find(|(name, _)| *name == case.name) {
                    for side in ["diffusers", "vae-parallel"] {
                        results.push(with_config(failure(case, side, why), case, dtype, threads, None))?;
                    }
                    continue;
                }
                // diffusers: one fresh worker per layout.
                let got = capture(Command::new(&python).args([
                    BENCH_SCRIPT,
                    "--family",
                    case.family,
                    "--task",
                    case.task.name(),
                    "--sizes",
                    &case.size.to_string(),
                    "--threads",
                    &t,
                    "--iters",
                    &iters,
                    "--dtypes",
                    dtype,
                    "--layouts",
                    &layouts,
                ]))?;
                let lines = json_lines(&got.stdout);
                for layout in &o.layouts {
                    let line = lines.iter().find(|v| {
                        v["impl"] == "diffusers" && v["kind"] == case.task.name() && v["layout"] == layout.as_str()
                    });
                    let record = match line {
                        Some(v) => v.clone(),
                        None => failure(
                            case,
                            "diffusers",
                            &format!("no result line ({})", first_error_line(&got.stderr, &got.status)),
                        ),
                    };
                    results.push(with_config(record, case, dtype, threads, Some(layout)))?;
                }
                // Ours: a fresh process.
                let input_flag = match case.task {
                    Task::Decode => "--latent",
                    Task::Encode => "--input",
                };
                let got = capture(Command::new(EXE).args([
                    "bench",
                    case.task.name(),
                    "--model",
                    &case.model_dir(),
                    input_flag,
                    &case.input(),
                    "--iters",
                    &iters,
                    "--threads",
                    &t,
                    "--dtype",
                    dtype,
                    "--json",
                ]))?;
                let line = json_lines(&got.stdout).into_iter().rev().find(|v| v["kind"] == case.task.name());
                let record = match (got.success, line) {
                    (true, Some(v)) => v,
                    _ => failure(case, "vae-parallel", &first_error_line(&got.stderr, &got.status)),
                };
                results.push(with_config(record, case, dtype, threads, None))?;
            }
        }
    }
    println!();
    print!("{}", render(&results.records));
    println!("raw results: {}", results.path.display());
    Ok(())
}

/// One side's numbers, or why there are none.
type Side<'a> = Result<&'a Value, String>;

fn side<'a>(records: &'a [&'a Value], impl_: &str, layout: Option<&str>) -> Side<'a> {
    let found = records.iter().find(|r| r["impl"] == impl_ && layout.is_none_or(|l| r["config"]["layout"] == l));
    match found {
        None => Err("not run".into()),
        Some(r) => match r["error"].as_str() {
            Some(e) => Err(e.to_string()),
            None if r["best_ms"].is_number() => Ok(r),
            None => Err("no timing in its result line".into()),
        },
    }
}

/// The 1-based number of `line` among the notes, added if new.
fn note(notes: &mut Vec<String>, line: String) -> usize {
    match notes.iter().position(|n| *n == line) {
        Some(k) => k + 1,
        None => {
            notes.push(line);
            notes.len()
        }
    }
}

fn num(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or(f64::NAN)
}

/// The table of a run's records (the machine record first, then one per side and
/// configuration), with its header, notes for the failures and the legend.
fn render(records: &[Value]) -> String {
    let mut s = String::new();
    let machine = records.iter().find(|r| r["kind"] == "machine");
    let text = |v: &Value| v.as_str().map_or_else(|| "?".to_string(), String::from);
    let iters = machine.and_then(|m| m["iters"].as_u64()).map_or("?".into(), |n| n.to_string());
    let _ = writeln!(
        s,
        "CPU comparison with diffusers: ours / the faster diffusers layout, best (median) of {iters} timed run(s) after \
         one warm-up, a fresh process per configuration, untiled, one rank"
    );
    if let Some(m) = machine {
        let flags = |key: &str| {
            m[key].as_array().map_or_else(String::new, |a| a.iter().map(text).collect::<Vec<_>>().join(" "))
        };
        let _ = writeln!(
            s,
            "machine: {}, {} logical CPU(s); SIMD: {} (absent: {})",
            text(&m["cpu"]),
            m["logical_cpus"],
            flags("simd"),
            flags("simd_absent")
        );
        let _ = writeln!(
            s,
            "torch {} (CPU capability {}), diffusers {}; vae-parallel {}",
            text(&m["torch"]),
            text(&m["cpu_capability"]),
            text(&m["diffusers"]),
            m["git"].as_str().unwrap_or("(commit unknown: not a git checkout)")
        );
    }
    // The cases of every machine record (a file may hold several runs).
    let mut legend: Vec<(String, String)> = Vec::new();
    for m in records.iter().filter(|r| r["kind"] == "machine") {
        for c in m["cases"].as_array().into_iter().flatten() {
            let case = (text(&c["name"]), text(&c["what"]));
            if !legend.contains(&case) {
                legend.push(case);
            }
        }
    }
    for (name, what) in &legend {
        let _ = writeln!(s, "  {name:<16} {what}");
    }
    // Configurations in the order they ran.
    let mut configs: Vec<(String, String, u64)> = Vec::new();
    for r in records.iter().filter(|r| r["config"].is_object()) {
        let key =
            (text(&r["config"]["case"]), text(&r["config"]["dtype"]), r["config"]["threads"].as_u64().unwrap_or(0));
        if !configs.contains(&key) {
            configs.push(key);
        }
    }
    let _ = writeln!(
        s,
        "{:<16} {:>5} {:>3}  {:>15}  {:>15}  {:>15}  {:>11}  {:>15}  {:>13}  {:>9}",
        "case",
        "dtype",
        "thr",
        "diffusers NCHW",
        "diffusers CL",
        "ours",
        "ratio",
        "diff. RSS MiB",
        "ours RSS MiB",
        "ours tens"
    );
    let _ = writeln!(
        s,
        "{:<16} {:>5} {:>3}  {:>15}  {:>15}  {:>15}  {:>11}  {:>15}  {:>13}  {:>9}",
        "", "", "", "ms best / med", "ms best / med", "ms best / med", "best (med)", "Δ / peak", "Δ / peak", "peak MiB"
    );
    let mut notes: Vec<String> = Vec::new();
    for (case, dtype, threads) in &configs {
        let rows: Vec<&Value> = records
            .iter()
            .filter(|r| {
                r["config"]["case"] == case.as_str()
                    && r["config"]["dtype"] == dtype.as_str()
                    && r["config"]["threads"].as_u64() == Some(*threads)
            })
            .collect();
        let mut cell = |side: &Side, who: &str| match side {
            Ok(v) => format!("{:.0} / {:.0}", num(v, "best_ms"), num(v, "median_ms")),
            Err(why) if why == "not run" => "-".to_string(),
            Err(why) => format!("n/a [{}]", note(&mut notes, format!("{who}, {case} {dtype} {threads} thr: {why}"))),
        };
        let nchw = side(&rows, "diffusers", Some("nchw"));
        let cl = side(&rows, "diffusers", Some("channels_last"));
        let ours = side(&rows, "vae-parallel", None);
        let nchw_cell = cell(&nchw, "diffusers NCHW");
        let cl_cell = cell(&cl, "diffusers channels-last");
        let ours_cell = cell(&ours, "ours");
        let best = [(nchw.ok(), "nchw"), (cl.ok(), "cl")]
            .into_iter()
            .filter_map(|(v, l)| Some((v?, l)))
            .min_by(|a, b| num(a.0, "best_ms").total_cmp(&num(b.0, "best_ms")));
        let (ratio, theirs_mem) = match (best, &ours) {
            (Some((d, l)), Ok(o)) => (
                format!(
                    "{:.2} ({:.2}) {l}",
                    num(o, "best_ms") / num(d, "best_ms"),
                    num(o, "median_ms") / num(d, "median_ms")
                ),
                format!("{:.0} / {:.0}", num(d, "decode_rss_mib"), num(d, "peak_rss_mib")),
            ),
            (Some((d, _)), Err(_)) => {
                ("n/a".into(), format!("{:.0} / {:.0}", num(d, "decode_rss_mib"), num(d, "peak_rss_mib")))
            }
            (None, _) => ("n/a".into(), "n/a".into()),
        };
        let (ours_mem, tensor) = match &ours {
            Ok(o) => (
                format!("{:.0} / {:.0}", num(o, "decode_rss_mib"), num(o, "peak_rss_mib")),
                format!("{:.0}", num(o, "peak_tensor_mib")),
            ),
            Err(_) => ("n/a".into(), "n/a".into()),
        };
        let _ = writeln!(
            s,
            "{case:<16} {dtype:>5} {threads:>3}  {nchw_cell:>15}  {cl_cell:>15}  {ours_cell:>15}  {ratio:>11}  \
             {theirs_mem:>15}  {ours_mem:>13}  {tensor:>9}"
        );
    }
    for (i, note) in notes.iter().enumerate() {
        let _ = writeln!(s, "[{}] {note}", i + 1);
    }
    let _ = writeln!(
        s,
        "ratio = ours / diffusers latency against the faster diffusers layout (nchw or cl = channels-last; project goal \
         ≤ 0.8).\nRSS: Δ = peak resident set during the timed runs minus the resident set after loading, peak = the \
         process' whole\nhigh-water mark (diffusers: of the faster layout). Tensor peak: vae-tensor's high-water mark of \
         live tensor bytes,\nweights included. bf16: diffusers casts model and input with .to(torch.bfloat16); ours \
         runs `--dtype bf16`.\n- = not run; n/a [k] = ran and failed, note k says why."
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_parse_and_refuse() {
        let o = parse_options(
            ["--cases", "flux1-256,wan21-enc-9x256", "--threads", "1", "--dtypes", "bf16", "--iters", "2"]
                .into_iter()
                .map(String::from),
        )
        .unwrap();
        assert_eq!(o.cases.iter().map(|c| c.name).collect::<Vec<_>>(), ["flux1-256", "wan21-enc-9x256"]);
        assert_eq!(
            (o.threads.as_slice(), o.dtypes.as_slice(), o.iters),
            ([1usize].as_slice(), ["bf16".to_string()].as_slice(), 2)
        );
        assert_eq!(o.layouts, ["nchw", "channels_last"]);
        for bad in [["--cases", "flux9"], ["--threads", "0"], ["--dtypes", "f16"], ["--iters", "0"]] {
            assert!(parse_options(bad.into_iter().map(String::from)).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn case_files() {
        let case = CASES.iter().find(|c| c.name == "wan21-enc-9x256").unwrap();
        assert_eq!(case.input(), "target/bench-models/wan21_geometry/x_256.npy");
        let case = CASES.iter().find(|c| c.name == "sd-512").unwrap();
        assert_eq!(case.input(), "target/bench-models/sd_geometry/z_512.npy");
    }

    #[test]
    fn timestamps_are_utc() {
        assert_eq!(utc_stamp(0), "19700101T000000Z");
        assert_eq!(utc_stamp(951_782_400), "20000229T000000Z");
        assert_eq!(utc_stamp(1_764_625_309), "20251201T214149Z");
    }

    #[test]
    fn error_lines() {
        assert_eq!(
            first_error_line("warning: x\nerror: --dtype bf16 needs a CUDA device\n  more\n", "exit 1"),
            "--dtype bf16 needs a CUDA device"
        );
        assert_eq!(
            first_error_line("Traceback (most recent call last):\n  File x\nRuntimeError: bad\n", "exit 1"),
            "RuntimeError: bad"
        );
        assert_eq!(first_error_line("", "exit status: 9"), "exited with exit status: 9");
    }

    #[test]
    fn cpu_flags() {
        let info =
            cpu_info("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 fma avx512f\nprocessor\t: 1\n");
        assert_eq!(info["cpu"], "AMD EPYC");
        assert_eq!(info["logical_cpus"], 2);
        assert_eq!(info["simd"], json!(["avx2", "fma", "avx512f"]));
        assert_eq!(info["simd_absent"], json!(["avx512bw", "avx512_bf16", "amx_bf16", "amx_tile"]));
    }

    #[test]
    fn table_takes_the_faster_layout_and_shows_failures() {
        let case = &CASES[0];
        let timing = |impl_: &str, best: f64| {
            json!({"kind": "decode", "impl": impl_, "best_ms": best, "median_ms": best + 1.0,
                   "decode_rss_mib": 10.0, "peak_rss_mib": 20.0, "peak_tensor_mib": 30.0})
        };
        let records = vec![
            json!({"kind": "machine", "cpu": "Test CPU", "logical_cpus": 2, "simd": ["avx2"], "simd_absent": ["amx_tile"],
                   "torch": "2.15.0", "diffusers": "0.38.0", "iters": 1}),
            with_config(timing("diffusers", 200.0), case, "f32", 1, Some("nchw")),
            with_config(timing("diffusers", 100.0), case, "f32", 1, Some("channels_last")),
            with_config(timing("vae-parallel", 150.0), case, "f32", 1, None),
            with_config(timing("diffusers", 80.0), case, "bf16", 1, Some("nchw")),
            with_config(failure(case, "diffusers", "RuntimeError: no"), case, "bf16", 1, Some("channels_last")),
            with_config(failure(case, "vae-parallel", "--dtype bf16 needs a CUDA device"), case, "bf16", 1, None),
        ];
        let table = render(&records);
        assert!(table.contains("machine: Test CPU, 2 logical CPU(s); SIMD: avx2 (absent: amx_tile)"), "{table}");
        let f32_row = table.lines().find(|l| l.starts_with("flux1-256") && l.contains("f32")).unwrap();
        assert!(f32_row.contains("1.50 (1.50) cl"), "{f32_row}");
        let bf16_row = table.lines().find(|l| l.starts_with("flux1-256") && l.contains("bf16")).unwrap();
        assert!(
            bf16_row.contains("80 / 81") && bf16_row.contains("n/a [1]") && bf16_row.contains("n/a [2]"),
            "{bf16_row}"
        );
        assert!(table.contains("[2] ours, flux1-256 bf16 1 thr: --dtype bf16 needs a CUDA device"), "{table}");
    }
}
