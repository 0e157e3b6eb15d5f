//! `vae-parallel bench serve`: a soak of a running service. N requests, a mix of cases (model,
//! decode or encode, input file, options), from C concurrent clients over plain HTTP/1.1; the
//! latency percentiles, throughput, the service's processes' RSS at request 100 and at the end,
//! and every answer compared bit for bit with the first answer to the same case. `--kill-rank`
//! then kills a rank process mid-request and times the recovery: the request that failed, and
//! the time until one succeeds again.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;

/// Options of `bench serve`.
#[derive(Debug, Args)]
pub struct ServeBenchArgs {
    /// The service, `http://host:port` (loopback: a soak sends traffic to this host only).
    #[arg(long)]
    url: String,
    /// A case: `MODEL,decode|encode,FILE[,OPTIONS_JSON]` (the options beyond the model, e.g.
    /// `{"vae_parallel_mode":"spatial_shard_height"}`); repeat; requests take them in turn.
    #[arg(long = "case", required = true)]
    cases: Vec<String>,
    /// Requests in all.
    #[arg(long, default_value_t = 1000)]
    requests: usize,
    /// Concurrent clients.
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// The serving process's pid: its RSS and its rank processes' are read at request 100 and
    /// at the end.
    #[arg(long)]
    pid: Option<u32>,
    /// A file holding the bearer token.
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// After the soak, kill a rank process (a child of --pid) 30 ms into a request of the first
    /// case (make it one that runs longer), and report how long until a request succeeds again.
    #[arg(long, requires = "pid")]
    kill_rank: bool,
}

struct Case {
    path: &'static str,
    options: String,
    body: Vec<u8>,
    label: String,
}

/// A minimal HTTP/1.1 exchange (one request per connection): the status and the body.
fn post(host: &str, path: &str, options: &str, token: Option<&str>, body: &[u8]) -> anyhow::Result<(u16, Vec<u8>)> {
    let mut stream = TcpStream::connect(host).with_context(|| format!("connecting to {host}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(600)))?;
    let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nX-VAE-Options: {options}\r\n{auth}Content-Length: {}\r\n\r\n",
        body.len()
    )?;
    stream.write_all(body)?;
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let status: u16 = line.split_whitespace().nth(1).and_then(|s| s.parse().ok()).context("no HTTP status")?;
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 || line == "\r\n" {
            break;
        }
    }
    let mut out = Vec::new();
    reader.read_to_end(&mut out)?;
    Ok((status, out))
}

/// RSS of `pid` and of each of its children, bytes (rank processes of a launched group).
fn rss(pid: u32) -> Vec<(u32, u64)> {
    let one = |p: u32| -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{p}/status")).ok()?;
        let kb = status.lines().find(|l| l.starts_with("VmRSS:"))?.split_whitespace().nth(1)?.parse::<u64>().ok()?;
        Some(kb * 1024)
    };
    let mut pids = vec![pid];
    pids.extend(children(pid));
    pids.into_iter().filter_map(|p| one(p).map(|r| (p, r))).collect()
}

fn children(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for task in tasks.flatten() {
            if let Ok(text) = std::fs::read_to_string(task.path().join("children")) {
                out.extend(text.split_whitespace().filter_map(|p| p.parse::<u32>().ok()));
            }
        }
    }
    out
}

fn show_rss(when: &str, rss: &[(u32, u64)]) {
    let parts: Vec<String> =
        rss.iter().map(|(p, r)| format!("pid {p} {:.1} MiB", *r as f64 / (1u64 << 20) as f64)).collect();
    println!("rss at {when}: {}", parts.join(", "));
}

/// `vae-parallel bench serve`.
pub fn run(args: &ServeBenchArgs) -> anyhow::Result<ExitCode> {
    let host =
        args.url.strip_prefix("http://").context("--url must be http://host:port")?.trim_end_matches('/').to_string();
    let token = match &args.token_file {
        Some(p) => Some(std::fs::read_to_string(p)?.trim().to_string()),
        None => None,
    };
    let mut cases = Vec::new();
    for spec in &args.cases {
        let mut parts = spec.splitn(4, ',');
        let (Some(model), Some(kind), Some(file)) = (parts.next(), parts.next(), parts.next()) else {
            bail!("--case {spec:?} must be MODEL,decode|encode,FILE[,OPTIONS_JSON]");
        };
        let path = match kind {
            "decode" => "/v1/decode",
            "encode" => "/v1/encode",
            other => bail!("--case {spec:?}: {other:?} is not decode or encode"),
        };
        let extra: serde_json::Value = serde_json::from_str(parts.next().unwrap_or("{}"))?;
        let mut options = serde_json::json!({ "model": model });
        if let serde_json::Value::Object(map) = extra {
            options.as_object_mut().unwrap().extend(map);
        }
        let body = std::fs::read(file).with_context(|| format!("--case {spec:?}"))?;
        cases.push(Case { path, options: options.to_string(), body, label: format!("{model} {kind} {file}") });
    }
    let cases = Arc::new(cases);
    let next = Arc::new(AtomicUsize::new(0));
    let firsts: Arc<Mutex<Vec<Option<Vec<u8>>>>> = Arc::new(Mutex::new(vec![None; cases.len()]));
    let latencies = Arc::new(Mutex::new(Vec::with_capacity(args.requests)));
    let failures = Arc::new(Mutex::new(Vec::<String>::new()));
    let rss_at_100 = Arc::new(Mutex::new(None));
    let started = Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..args.clients {
            let (cases, next, firsts, latencies, failures, rss_at_100) =
                (&cases, &next, &firsts, &latencies, &failures, &rss_at_100);
            let (host, token, pid, total) = (&host, token.as_deref(), args.pid, args.requests);
            scope.spawn(move || {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total {
                        return;
                    }
                    let which = i % cases.len();
                    let case = &cases[which];
                    let t = Instant::now();
                    let result = post(host, case.path, &case.options, token, &case.body);
                    let ms = t.elapsed().as_secs_f64() * 1e3;
                    match result {
                        Ok((200, body)) => {
                            latencies.lock().unwrap().push(ms);
                            let mut firsts = firsts.lock().unwrap();
                            match &firsts[which] {
                                None => firsts[which] = Some(body),
                                Some(first) if *first == body => {}
                                Some(_) => failures
                                    .lock()
                                    .unwrap()
                                    .push(format!("request {i} ({}): different bits", case.label)),
                            }
                        }
                        Ok((status, body)) => failures.lock().unwrap().push(format!(
                            "request {i} ({}): {status} {}",
                            case.label,
                            String::from_utf8_lossy(&body).trim()
                        )),
                        Err(e) => failures.lock().unwrap().push(format!("request {i} ({}): {e:#}", case.label)),
                    }
                    if i == 99
                        && let Some(pid) = pid
                    {
                        *rss_at_100.lock().unwrap() = Some(rss(pid));
                    }
                }
            });
        }
    });
    let seconds = started.elapsed().as_secs_f64();
    let mut lat = latencies.lock().unwrap().clone();
    lat.sort_by(f64::total_cmp);
    let pct = |p: f64| lat.get(((lat.len() as f64 * p).ceil() as usize).saturating_sub(1)).copied().unwrap_or(f64::NAN);
    println!(
        "{} request(s) from {} client(s), {} case(s): {:.1} s, {:.2} req/s; latency p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        args.requests,
        args.clients,
        cases.len(),
        seconds,
        args.requests as f64 / seconds,
        pct(0.5),
        pct(0.99),
        lat.last().copied().unwrap_or(f64::NAN)
    );
    if let Some(pid) = args.pid {
        if let Some(at100) = rss_at_100.lock().unwrap().as_ref() {
            show_rss("request 100", at100);
        }
        show_rss(&format!("request {}", args.requests), &rss(pid));
    }
    let failures = failures.lock().unwrap();
    println!("{} answer(s) failed or differed from their case's first answer", failures.len());
    for f in failures.iter().take(10) {
        println!("  {f}");
    }
    if args.kill_rank {
        let pid = args.pid.unwrap_or_default();
        kill_rank(&host, token.as_deref(), pid, &cases[0])?;
    }
    Ok(if failures.is_empty() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// Kills a rank process while `case` runs; reports that request's answer and the time from the
/// kill until `case` succeeds again.
fn kill_rank(host: &str, token: Option<&str>, pid: u32, case: &Case) -> anyhow::Result<()> {
    let Some(&rank) = children(pid).first() else { bail!("--kill-rank: process {pid} has no rank process") };
    let (host2, options, body, path) = (host.to_string(), case.options.clone(), case.body.clone(), case.path);
    let token2 = token.map(str::to_string);
    let in_flight = std::thread::spawn(move || post(&host2, path, &options, token2.as_deref(), &body));
    std::thread::sleep(Duration::from_millis(30));
    let killed = Instant::now();
    std::process::Command::new("kill").args(["-KILL", &rank.to_string()]).status()?;
    let answer = in_flight.join().map_err(|_| anyhow::anyhow!("the request's thread panicked"))??;
    let answered_ms = killed.elapsed().as_secs_f64() * 1e3;
    match answer.0 {
        200 => println!("killed rank process {rank}: the request had already finished (200); use a longer case"),
        status => println!(
            "killed rank process {rank} mid-request: that request got {status} {} ({answered_ms:.0} ms after the kill)",
            String::from_utf8_lossy(&answer.1).trim()
        ),
    }
    let retried = Instant::now();
    loop {
        let (status, _) = post(host, case.path, &case.options, token, &case.body)?;
        if status == 200 {
            break;
        }
        if killed.elapsed() > Duration::from_secs(120) {
            bail!("no request succeeded within 120 s of the kill");
        }
    }
    println!(
        "recovered: the next request succeeded {:.0} ms after the kill ({:.0} ms of it that request itself, the \
         group's rebuild included)",
        killed.elapsed().as_secs_f64() * 1e3,
        retried.elapsed().as_secs_f64() * 1e3
    );
    Ok(())
}
