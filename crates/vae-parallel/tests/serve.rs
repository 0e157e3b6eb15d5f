//! `vae-parallel serve` end to end: the real binary on a loopback port, driven with curl. Every
//! family's decode and encode equals the CLI's `.npy` bit for bit, a streamed decode equals the
//! whole, bad input gets a 4xx with one line (and the next request succeeds), the trust rules
//! hold, and a service over socket rank processes replaces a rank that died and leaves none
//! behind when it stops.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const EXE: &str = env!("CARGO_BIN_EXE_vae-parallel");

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

/// (name, model dir, decode input, encode input) of one model per family.
fn families() -> Vec<(&'static str, PathBuf, PathBuf, PathBuf)> {
    let f = fixtures();
    let one = |name, dir: &str, model: &str, decode: &str, encode: &str| {
        let d = f.join(dir);
        (name, d.join(model), d.join(format!("{model}.{decode}.in.npy")), d.join(format!("{model}.{encode}.in.npy")))
    };
    vec![
        one("sd", "autoencoder_kl", "sd_like", "decode", "encode"),
        one("flux2", "autoencoder_kl", "flux2_like", "decode", "encode"),
        one("wan", "wan", "wan21_like", "decode_t3", "encode_f5"),
        one("qwen", "qwen_image", "qwen_image_like", "decode_t3", "encode_f5"),
        one("hv15", "hunyuan_video15", "hunyuan_video15_like", "decode_t3", "encode_f5"),
        one("ltx", "ltx", "ltx_video_like", "decode_t3", "encode_f5"),
    ]
}

/// A running service; stopped with SIGTERM when dropped.
struct Server {
    child: Child,
    base: String,
}

impl Server {
    fn start(args: &[String]) -> Server {
        let mut child = Command::new(EXE)
            .arg("serve")
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .env("VAE_COST_PROBE", "0")
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting the service");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let base = loop {
            let line = lines.next().expect("the service exited before listening").unwrap();
            if let Some(addr) = line.strip_prefix("listening on ") {
                break addr.to_string();
            }
        };
        // Keep reading (and dropping) what it prints, so that it never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Server { child, base }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// SIGTERM, then the exit status (within 30 s).
    fn stop(&mut self) -> std::process::ExitStatus {
        let _ = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "the service did not stop within 30 s of SIGTERM");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// What curl received.
struct Reply {
    status: u16,
    headers: String,
    body: Vec<u8>,
}

impl Reply {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    fn header(&self, name: &str) -> Option<String> {
        self.headers.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim().eq_ignore_ascii_case(name).then(|| v.trim().to_string())
        })
    }

    /// A refusal: the status, and a body of one line.
    fn assert_refused(&self, status: u16, words: &str) {
        let text = self.text();
        assert_eq!(self.status, status, "{text}");
        assert!(text.ends_with('\n') && text.trim_end().lines().count() == 1, "not one line: {text:?}");
        assert!(text.contains(words), "{text:?} does not say {words:?}");
    }
}

/// A request through curl: `options` in X-VAE-Options, `body` from a file.
fn curl(url: &str, options: Option<&str>, body: Option<&Path>, extra: &[&str]) -> Reply {
    let dir = tempfile::tempdir().unwrap();
    let (out, head) = (dir.path().join("body"), dir.path().join("headers"));
    let mut cmd = Command::new("curl");
    cmd.args(["-sS", "-o"]).arg(&out).arg("-D").arg(&head).args(["-w", "%{http_code}"]);
    if let Some(options) = options {
        cmd.args(["-H", &format!("X-VAE-Options: {options}")]);
    }
    if let Some(body) = body {
        cmd.arg("--data-binary").arg(format!("@{}", body.display()));
    }
    cmd.args(extra).arg(url);
    let done = cmd.output().expect("running curl");
    let status = String::from_utf8_lossy(&done.stdout).trim().parse().unwrap_or(0);
    Reply {
        status,
        headers: std::fs::read_to_string(&head).unwrap_or_default(),
        body: std::fs::read(&out).unwrap_or_default(),
    }
}

/// The CLI's answer: `decode`/`encode` of `input` with `flags`, the `--out` file's bytes.
fn cli(command: &str, model: &Path, input: &Path, out_name: &str, flags: &[&str]) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join(out_name);
    let input_flag = if command == "decode" { "--latent" } else { "--input" };
    let done = Command::new(EXE)
        .args([command, "--model"])
        .arg(model)
        .arg(input_flag)
        .arg(input)
        .arg("--out")
        .arg(&out)
        .args(flags)
        .env("VAE_COST_PROBE", "0")
        .output()
        .unwrap();
    assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
    std::fs::read(&out).unwrap()
}

fn model_flags(models: &[(&str, PathBuf, PathBuf, PathBuf)]) -> Vec<String> {
    models.iter().flat_map(|(name, dir, _, _)| ["--model".to_string(), format!("{name}={}", dir.display())]).collect()
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// Splits a stream of `.npy` arrays into (shape, values).
fn npy_chunks(mut bytes: &[u8]) -> Vec<(Vec<usize>, Vec<f32>)> {
    let mut out = Vec::new();
    while !bytes.is_empty() {
        assert_eq!(&bytes[..6], b"\x93NUMPY");
        let header_len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
        let header = std::str::from_utf8(&bytes[10..10 + header_len]).unwrap();
        let shape_text = header.split("'shape': (").nth(1).unwrap().split(')').next().unwrap();
        let shape: Vec<usize> =
            shape_text.split(',').filter(|s| !s.trim().is_empty()).map(|s| s.trim().parse().unwrap()).collect();
        let end = 10 + header_len + shape.iter().product::<usize>() * 4;
        let tensor = vae_parallel::io::npy_from_bytes(&bytes[..end]).unwrap();
        out.push((shape, tensor.to_vec_f32().unwrap()));
        bytes = &bytes[end..];
    }
    out
}

#[test]
fn every_familys_decode_and_encode_match_the_cli_bit_for_bit() {
    let models = families();
    let mut args = model_flags(&models);
    args.extend(strings(&["--vae-patch-parallel-size", "2"]));
    let server = Server::start(&args);
    let flags = ["--vae-patch-parallel-size", "2"];
    for (name, dir, decode_in, encode_in) in &models {
        let options = format!(r#"{{"model":"{name}"}}"#);
        let served = curl(&server.url("/v1/decode"), Some(&options), Some(decode_in), &[]);
        assert_eq!(served.status, 200, "{name} decode: {}", served.text());
        assert_eq!(
            served.body,
            cli("decode", dir, decode_in, "out.npy", &flags),
            "{name}: decode differs from the CLI's"
        );
        let report: serde_json::Value = serde_json::from_str(&served.header("x-vae-report").unwrap()).unwrap();
        assert!(report["strategy"].is_string() && report["ranks"].as_array().unwrap().len() == 2, "{report}");
        let served = curl(&server.url("/v1/encode"), Some(&options), Some(encode_in), &[]);
        assert_eq!(served.status, 200, "{name} encode: {}", served.text());
        assert_eq!(
            served.body,
            cli("encode", dir, encode_in, "out.npy", &flags),
            "{name}: encode differs from the CLI's"
        );
    }
    // Moments, the same as the CLI's --output moments.
    let (_, sd, _, sd_image) = &models[0];
    let served = curl(&server.url("/v1/encode"), Some(r#"{"model":"sd","output":"moments"}"#), Some(sd_image), &[]);
    assert_eq!(served.body, cli("encode", sd, sd_image, "m.npy", &[&flags[..], &["--output", "moments"]].concat()));
    // A PNG answer is the CLI's PNG file.
    let (_, _, sd_latent, _) = &models[0];
    let png = curl(&server.url("/v1/decode"), Some(r#"{"model":"sd","response":"png"}"#), Some(sd_latent), &[]);
    assert_eq!(png.status, 200, "{}", png.text());
    assert_eq!(png.header("content-type").as_deref(), Some("image/png"));
    assert_eq!(png.body, cli("decode", sd, sd_latent, "out.png", &flags));
    // The same latent as .safetensors gives the same pixels.
    let latent = vae_parallel::io::read_npy(sd_latent).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let st = dir.path().join("z.safetensors");
    let data: Vec<u8> = latent.to_vec_f32().unwrap().iter().flat_map(|v| v.to_le_bytes()).collect();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, latent.dims().to_vec(), &data).unwrap();
    safetensors::serialize_to_file([("z", view)], None, &st).unwrap();
    let from_st = curl(&server.url("/v1/decode"), Some(r#"{"model":"sd"}"#), Some(&st), &[]);
    assert_eq!(from_st.body, cli("decode", sd, sd_latent, "out.npy", &flags));
    // The models and the metrics say what was served.
    let listed = curl(&server.url("/v1/models"), None, None, &[]);
    let listed: serde_json::Value = serde_json::from_slice(&listed.body).unwrap();
    assert_eq!(listed["models"].as_array().unwrap().len(), models.len());
    let metrics = curl(&server.url("/metrics"), None, None, &[]).text();
    assert!(metrics.contains(r#"vae_requests_total{model="sd",kind="decode",outcome="ok"} 3"#), "{metrics}");
    assert!(metrics.contains("vae_last_request_peak_bytes{rank=\"1\"}"), "{metrics}");
}

#[test]
fn a_streamed_decode_is_the_whole_decode_frame_by_frame() {
    let models: Vec<_> = families().into_iter().filter(|m| m.0 == "wan").collect();
    let mut args = model_flags(&models);
    args.extend(strings(&["--vae-patch-parallel-size", "2", "--vae-parallel-mode", "spatial_shard_height"]));
    let server = Server::start(&args);
    let latent = &models[0].2;
    let whole = curl(&server.url("/v1/decode"), Some(r#"{"model":"wan"}"#), Some(latent), &[]);
    assert_eq!(whole.status, 200, "{}", whole.text());
    let streamed = curl(&server.url("/v1/decode"), Some(r#"{"model":"wan","response":"frames"}"#), Some(latent), &[]);
    assert_eq!(streamed.status, 200, "{}", streamed.text());
    assert_eq!(streamed.header("transfer-encoding").as_deref(), Some("chunked"));
    let whole = npy_chunks(&whole.body).pop().unwrap();
    let chunks = npy_chunks(&streamed.body);
    assert!(chunks.len() > 1, "one chunk: nothing was streamed");
    // Concatenated along the frames' axis, the runs are the whole decode, bit for bit.
    let [b, c, t, h, w] = whole.0[..] else { panic!("{:?}", whole.0) };
    let mut joined = vec![f32::NAN; whole.1.len()];
    let mut first = 0;
    for (shape, values) in &chunks {
        let n = shape[2];
        assert_eq!((shape[0], shape[1], shape[3], shape[4]), (b, c, h, w));
        for (i, v) in values.iter().enumerate() {
            let (bc, rest) = (i / (n * h * w), i % (n * h * w));
            joined[bc * t * h * w + first * h * w + rest] = *v;
        }
        first += n;
    }
    assert_eq!(first, t);
    assert!(joined.iter().zip(&whole.1).all(|(a, b)| a.to_bits() == b.to_bits()), "the streamed frames differ");
    // A GIF answer is the CLI's GIF file.
    let gif = curl(&server.url("/v1/decode"), Some(r#"{"model":"wan","response":"gif"}"#), Some(latent), &[]);
    assert_eq!(gif.status, 200, "{}", gif.text());
    let flags = ["--vae-patch-parallel-size", "2", "--vae-parallel-mode", "spatial_shard_height"];
    assert_eq!(gif.body, cli("decode", &models[0].1, latent, "out.gif", &flags));
}

#[test]
fn bad_input_gets_a_4xx_with_one_line_and_the_service_keeps_serving() {
    let models: Vec<_> = families().into_iter().filter(|m| m.0 == "sd").collect();
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "s3cret-token\n").unwrap();
    let mut args = model_flags(&models);
    args.extend(strings(&["--max-body", "64K", "--token-file", token_file.to_str().unwrap()]));
    let server = Server::start(&args);
    let auth = ["-H", "Authorization: Bearer s3cret-token"];
    let decode = server.url("/v1/decode");
    let good_latent = &models[0].2;
    let good = || {
        let reply = curl(&decode, Some(r#"{"model":"sd"}"#), Some(good_latent), &auth);
        assert_eq!(reply.status, 200, "the next request failed: {}", reply.text());
    };
    good();
    let write = |name: &str, bytes: &[u8]| {
        let path = dir.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        path
    };
    let npy = |dims: &[usize], fill: f32| {
        let t = vae_parallel::Tensor::from_vec(
            vec![fill; dims.iter().product()],
            dims.to_vec(),
            &vae_parallel::Device::Cpu,
        )
        .unwrap();
        vae_parallel::io::npy_bytes(&t).unwrap()
    };
    let good_bytes = std::fs::read(good_latent).unwrap();
    // (what, body, options, status, words the line holds, extra curl arguments)
    type Case<'a> = (&'a str, Option<PathBuf>, &'a str, u16, &'a str, &'a [&'a str]);
    let cases: Vec<Case> = vec![
        (
            "truncated npy",
            Some(write("t.npy", &good_bytes[..good_bytes.len() - 7])),
            r#"{"model":"sd"}"#,
            422,
            "",
            &auth,
        ),
        ("wrong rank", Some(write("r.npy", &npy(&[4, 8, 8], 0.1))), r#"{"model":"sd"}"#, 422, "", &auth),
        ("NaN", Some(write("n.npy", &npy(&[1, 4, 8, 8], f32::NAN))), r#"{"model":"sd"}"#, 422, "non-finite", &auth),
        ("unknown model", Some(good_latent.clone()), r#"{"model":"/etc"}"#, 404, "unknown model", &auth),
        ("oversized body", Some(write("big.npy", &npy(&[1, 4, 96, 96], 0.1))), r#"{"model":"sd"}"#, 413, "cap", &auth),
        ("malformed JSON", Some(good_latent.clone()), r#"{"model":"sd""#, 400, "not valid options JSON", &auth),
        ("unknown option", Some(good_latent.clone()), r#"{"model":"sd","ranks":8}"#, 400, "unknown field", &auth),
        (
            "bad mode",
            Some(good_latent.clone()),
            r#"{"model":"sd","vae_parallel_mode":"sideways"}"#,
            400,
            "`vae_parallel_mode`",
            &auth,
        ),
        (
            "never fits the memory cap",
            Some(good_latent.clone()),
            r#"{"model":"sd","vae_parallel_mode":"auto","max_memory_per_rank":"1K"}"#,
            422,
            "the smallest predicted peak per rank",
            &auth,
        ),
        ("no options", Some(good_latent.clone()), "", 400, "X-VAE-Options", &auth),
        ("missing token", Some(good_latent.clone()), r#"{"model":"sd"}"#, 401, "bearer token is required", &[]),
        (
            "wrong token",
            Some(good_latent.clone()),
            r#"{"model":"sd"}"#,
            401,
            "wrong",
            &["-H", "Authorization: Bearer s3cret-tokeX"],
        ),
    ];
    for (what, body, options, status, words, headers) in cases {
        let options = (!options.is_empty()).then_some(options);
        let reply = curl(&decode, options, body.as_deref(), headers);
        assert_eq!(reply.status, status, "{what}: {}", reply.text());
        reply.assert_refused(status, words);
        good();
    }
    // The probes need no token; the rest does.
    assert_eq!(curl(&server.url("/healthz"), None, None, &[]).status, 200);
    assert_eq!(curl(&server.url("/readyz"), None, None, &[]).status, 200);
    assert_eq!(curl(&server.url("/metrics"), None, None, &[]).status, 401);
    let metrics = curl(&server.url("/metrics"), None, None, &auth).text();
    assert!(metrics.contains(r#"outcome="invalid_input"}"#), "{metrics}");
}

#[test]
fn a_reachable_address_without_a_token_is_refused_before_anything_loads() {
    let done =
        Command::new(EXE).args(["serve", "--listen", "0.0.0.0:0", "--model", "m=/nonexistent"]).output().unwrap();
    assert!(!done.status.success());
    let stderr = String::from_utf8_lossy(&done.stderr);
    assert!(stderr.contains("--token-file"), "{stderr}");
}

/// The pids of `parent`'s children.
fn children(parent: u32) -> Vec<u32> {
    let out = Command::new("pgrep").args(["-P", &parent.to_string()]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| l.trim().parse().ok()).collect()
}

#[test]
fn socket_ranks_serve_the_same_bits_and_a_rank_that_dies_is_replaced() {
    let models: Vec<_> = families().into_iter().filter(|m| m.0 == "sd").collect();
    let mut args = model_flags(&models);
    args.extend(strings(&["--transport", "socket", "--ranks", "2", "--vae-patch-parallel-size", "2"]));
    let mut server = Server::start(&args);
    let (_, dir, latent, _) = &models[0];
    let expected = cli("decode", dir, latent, "out.npy", &["--vae-patch-parallel-size", "2"]);
    let decode = || curl(&server.url("/v1/decode"), Some(r#"{"model":"sd"}"#), Some(latent), &[]);
    let first = decode();
    assert_eq!(first.status, 200, "{}", first.text());
    assert_eq!(first.body, expected);
    assert!(first.header("x-vae-report").unwrap().contains(r#""backend":"socket""#));
    // Rank 1 is killed: the service replaces it before the next request.
    let ranks = children(server.child.id());
    assert_eq!(ranks.len(), 1, "one launched rank process: {ranks:?}");
    let _ = Command::new("kill").args(["-KILL", &ranks[0].to_string()]).status();
    std::thread::sleep(Duration::from_millis(200));
    let next = decode();
    assert_eq!(next.status, 200, "{}", next.text());
    assert_eq!(next.body, expected);
    let relaunched = children(server.child.id());
    assert_eq!(relaunched.len(), 1);
    assert_ne!(relaunched, ranks);
    let metrics = curl(&server.url("/metrics"), None, None, &[]).text();
    assert!(metrics.contains("vae_group_rebuilds_total 1"), "{metrics}");
    // SIGTERM under load: the request in flight finishes (200), then a clean exit and no rank
    // process left.
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("big.npy");
    let latent =
        vae_parallel::Tensor::seeded_uniform([1, 4, 64, 64], 5, -1.0, 1.0, &vae_parallel::Device::Cpu).unwrap();
    vae_parallel::io::write_npy(&big, &latent).unwrap();
    let in_flight = Command::new("curl")
        .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", "-H", r#"X-VAE-Options: {"model":"sd"}"#])
        .arg("--data-binary")
        .arg(format!("@{}", big.display()))
        .arg(server.url("/v1/decode"))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !curl(&server.url("/metrics"), None, None, &[]).text().contains("vae_requests_running 1") {
        assert!(Instant::now() < deadline, "the request did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let status = server.stop();
    let answered = in_flight.wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&answered.stdout), "200", "the request in flight did not finish");
    assert!(status.success(), "{status:?}");
    for pid in relaunched {
        assert!(!Path::new(&format!("/proc/{pid}")).exists(), "rank process {pid} was left behind");
    }
}

/// The number after `name` (a whole metric line's name and labels) in the exposition.
fn metric(server: &Server, name: &str) -> f64 {
    let text = curl(&server.url("/metrics"), None, None, &[]).text();
    text.lines().find_map(|l| l.strip_prefix(name)?.trim().parse().ok()).unwrap_or(0.0)
}

/// Polls until `metric` reaches `value` (10 s at most).
fn wait_for(server: &Server, name: &str, value: f64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(server, name) != value {
        assert!(Instant::now() < deadline, "{name} did not reach {value}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_full_queue_answers_429_and_a_client_that_leaves_cancels_its_request() {
    let models: Vec<_> = families().into_iter().filter(|m| m.0 == "sd").collect();
    let mut args = model_flags(&models);
    args.extend(strings(&["--queue", "1"]));
    let server = Server::start(&args);
    // A latent whose decode takes a while (a second or more here), so that requests overlap.
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("big.npy");
    let latent =
        vae_parallel::Tensor::seeded_uniform([1, 4, 80, 80], 3, -1.0, 1.0, &vae_parallel::Device::Cpu).unwrap();
    vae_parallel::io::write_npy(&big, &latent).unwrap();
    let spawn = |extra: &[&str]| {
        let mut cmd = Command::new("curl");
        cmd.args(["-s", "-o", "/dev/null", "-w", "%{http_code}", "-H", r#"X-VAE-Options: {"model":"sd"}"#])
            .arg("--data-binary")
            .arg(format!("@{}", big.display()))
            .args(extra)
            .arg(server.url("/v1/decode"))
            .stdout(Stdio::piped());
        cmd.spawn().unwrap()
    };
    let first_started = Instant::now();
    let running = spawn(&[]);
    wait_for(&server, "vae_requests_running", 1.0);
    let queued = spawn(&[]);
    wait_for(&server, "vae_queue_depth", 1.0);
    // One running, one waiting: the queue of one is full.
    let refused = curl(&server.url("/v1/decode"), Some(r#"{"model":"sd"}"#), Some(&big), &[]);
    refused.assert_refused(429, "queue is full");
    assert!(refused.header("retry-after").is_some_and(|s| s.parse::<u64>().unwrap() >= 1));
    let out = running.wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "200");
    // At least one whole decode of the latent (it ran alone).
    let whole = first_started.elapsed();
    let out = queued.wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "200");
    // A client that gives up: its request is cancelled, counted, and the group is free at once.
    let t = Instant::now();
    let gone = spawn(&["--max-time", "0.3"]).wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&gone.stdout), "000");
    wait_for(&server, r#"vae_requests_total{model="sd",kind="decode",outcome="cancelled"}"#, 1.0);
    wait_for(&server, "vae_requests_running", 0.0);
    // It stopped before a whole decode's time: cancelled, not run to its end.
    assert!(t.elapsed() < whole, "the abandoned request ran {:?}, a whole decode {whole:?}", t.elapsed());
    let small = curl(&server.url("/v1/decode"), Some(r#"{"model":"sd"}"#), Some(&models[0].2), &[]);
    assert_eq!(small.status, 200);
}

#[test]
fn ranks_placed_by_the_environment_that_die_make_the_service_unready() {
    let models: Vec<_> = families().into_iter().filter(|m| m.0 == "sd").collect();
    let dir = tempfile::tempdir().unwrap();
    let master = format!("unix:{}", dir.path().join("m.sock").display());
    let mut args = model_flags(&models);
    args.extend(strings(&["--transport", "socket", "--ranks", "2", "--vae-patch-parallel-size", "2"]));
    let env = |rank: &str| {
        [("VAE_RANK", rank.to_string()), ("VAE_WORLD_SIZE", "2".into()), ("VAE_MASTER_ADDR", master.clone())]
    };
    let mut rank1 = Command::new(EXE)
        .arg("serve")
        .args(["--listen", "127.0.0.1:0"])
        .args(&args)
        .envs(env("1"))
        .env("VAE_FAILURE_TIMEOUT_S", "1")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    // Rank 0 serves HTTP.
    let server = {
        let mut child = Command::new(EXE)
            .arg("serve")
            .args(["--listen", "127.0.0.1:0"])
            .args(&args)
            .envs(env("0"))
            .env("VAE_FAILURE_TIMEOUT_S", "1")
            .env("VAE_COST_PROBE", "0")
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let base = loop {
            let line = lines.next().expect("rank 0 exited before listening").unwrap();
            if let Some(addr) = line.strip_prefix("listening on ") {
                break addr.to_string();
            }
        };
        std::thread::spawn(move || for _ in lines {});
        Server { child, base }
    };
    let reply = curl(&server.url("/v1/decode"), Some(r#"{"model":"sd"}"#), Some(&models[0].2), &[]);
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(curl(&server.url("/readyz"), None, None, &[]).status, 200);
    rank1.kill().unwrap();
    rank1.wait().unwrap();
    // Unready within a few seconds, without a request to find it; requests are then refused.
    let deadline = Instant::now() + Duration::from_secs(15);
    while curl(&server.url("/readyz"), None, None, &[]).status != 503 {
        assert!(Instant::now() < deadline, "/readyz stayed 200 after rank 1 died");
        std::thread::sleep(Duration::from_millis(100));
    }
    let refused = curl(&server.url("/v1/decode"), Some(r#"{"model":"sd"}"#), Some(&models[0].2), &[]);
    refused.assert_refused(503, "rank 1");
}

#[test]
fn slow_and_idle_connections_time_out() {
    use std::io::{Read, Write};
    let models: Vec<_> = families().into_iter().filter(|m| m.0 == "sd").collect();
    let mut args = model_flags(&models);
    args.extend(strings(&["--read-timeout-s", "1"]));
    let server = Server::start(&args);
    let addr = server.base.strip_prefix("http://").unwrap().to_string();
    // What the server answers (and when) to a connection that sends `bytes` and then stalls.
    let stall = |bytes: &[u8]| {
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let t = Instant::now();
        s.write_all(bytes).unwrap();
        let mut answer = Vec::new();
        let _ = s.read_to_end(&mut answer);
        (t.elapsed(), String::from_utf8_lossy(&answer).into_owned())
    };
    let (idle, answer) = stall(b"");
    assert!(idle < Duration::from_secs(5) && answer.is_empty(), "{idle:?} {answer:?}");
    let (half, _) = stall(b"POST /v1/decode HTTP/1.1\r\nHost: x\r\n");
    assert!(half < Duration::from_secs(5), "{half:?}");
    let (slow, answer) = stall(
        b"POST /v1/decode HTTP/1.1\r\nHost: x\r\nX-VAE-Options: {\"model\":\"sd\"}\r\nContent-Length: 1000\r\n\r\nabc",
    );
    assert!(slow < Duration::from_secs(5) && answer.starts_with("HTTP/1.1 408"), "{slow:?} {answer:?}");
    // Still serving.
    let reply = curl(&server.url("/v1/decode"), Some(r#"{"model":"sd"}"#), Some(&models[0].2), &[]);
    assert_eq!(reply.status, 200);
}

/// A `.npy` of `shape` (f32, small values) at `path`.
fn write_npy(path: &Path, shape: &[usize]) {
    let dims: Vec<String> = shape.iter().map(ToString::to_string).collect();
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({},), }}", dims.join(", "));
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    let n: usize = shape.iter().product();
    for i in 0..n {
        bytes.extend_from_slice(&(((i % 97) as f32 / 97.0) - 0.5).to_le_bytes());
    }
    std::fs::write(path, bytes).unwrap();
}

/// Sends a streamed decode of `body` over a raw connection and never reads the answer.
fn stalled_frames_request(server: &Server, body: &[u8]) -> std::net::TcpStream {
    use std::io::Write as _;
    let addr = server.base.strip_prefix("http://").unwrap();
    let mut conn = std::net::TcpStream::connect(addr).unwrap();
    let head = format!(
        "POST /v1/decode HTTP/1.1\r\nHost: {addr}\r\nX-VAE-Options: {{\"model\":\"wan\",\"response\":\"frames\"}}\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes()).unwrap();
    conn.write_all(body).unwrap();
    conn
}

#[test]
fn a_client_that_stops_reading_its_frames_holds_neither_the_group_nor_the_shutdown() {
    let models: Vec<_> = families().into_iter().filter(|m| m.0 == "wan").collect();
    let mut args = model_flags(&models);
    args.extend(strings(&["--read-timeout-s", "8", "--grace-s", "1"]));
    let mut server = Server::start(&args);
    let dir = tempfile::tempdir().unwrap();
    // A decode whose frames (about 16 MB) are far more than the socket buffers and the
    // service's four chunks hold.
    let big = dir.path().join("big.npy");
    write_npy(&big, &[1, 16, 21, 16, 16]);
    let body = std::fs::read(&big).unwrap();
    let stalled = stalled_frames_request(&server, &body);
    std::thread::sleep(Duration::from_millis(500));
    // The next request is served once the stalled one is given up on (8 s), not never.
    let started = Instant::now();
    let latent = &models[0].2;
    let next = curl(&server.url("/v1/decode"), Some(r#"{"model":"wan"}"#), Some(latent), &["--max-time", "120"]);
    assert_eq!(next.status, 200, "{}", next.text());
    assert!(started.elapsed() < Duration::from_secs(60), "took {:?}", started.elapsed());
    drop(stalled);
    // A second client stalls; SIGTERM ends the service within its grace (1 s) and a margin,
    // well before the stall limit (8 s) would have freed the group.
    let _stalled = stalled_frames_request(&server, &body);
    std::thread::sleep(Duration::from_millis(1500));
    let started = Instant::now();
    let status = server.stop();
    assert!(status.success(), "{status:?}");
    assert!(started.elapsed() < Duration::from_secs(6), "stopped after {:?}", started.elapsed());
}

#[test]
fn bodies_beyond_the_queue_are_refused_before_they_are_read() {
    use std::io::Write as _;
    let models: Vec<_> = families().into_iter().filter(|m| m.0 == "sd").collect();
    let mut args = model_flags(&models);
    args.extend(strings(&["--queue", "1"]));
    let server = Server::start(&args);
    let addr = server.base.strip_prefix("http://").unwrap().to_string();
    // Two bodies (the queue's one + the one running) that arrive slowly hold both permits.
    let slow: Vec<_> = (0..2)
        .map(|_| {
            let mut conn = std::net::TcpStream::connect(&addr).unwrap();
            let head = format!(
                "POST /v1/decode HTTP/1.1\r\nHost: {addr}\r\nX-VAE-Options: {{\"model\":\"sd\"}}\r\nContent-Length: 100000\r\n\r\nNUMPY"
            );
            conn.write_all(head.as_bytes()).unwrap();
            conn
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let refused = curl(&server.url("/v1/decode"), Some(r#"{"model":"sd"}"#), Some(&models[0].2), &[]);
    refused.assert_refused(429, "queue is full");
    assert!(refused.header("retry-after").is_some());
    // The slow clients leave: their permits are free again.
    drop(slow);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let reply = curl(&server.url("/v1/decode"), Some(r#"{"model":"sd"}"#), Some(&models[0].2), &[]);
        if reply.status == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "still refused: {} {}", reply.status, reply.text());
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_unix_socket_serves_decodes_to_its_owner_only() {
    use std::os::unix::fs::PermissionsExt as _;
    let models: Vec<_> = families().into_iter().filter(|m| m.0 == "sd").collect();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("vae.sock");
    // A stale socket from a service that did not stop cleanly is replaced.
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
    assert!(socket.exists());
    let mut args = model_flags(&models);
    args.extend(strings(&["--listen", &format!("unix:{}", socket.display())]));
    let mut child = Command::new(EXE)
        .arg("serve")
        .args(&args)
        .env("VAE_COST_PROBE", "0")
        .stdout(Stdio::piped())
        .spawn()
        .expect("starting the service");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    loop {
        let line = lines.next().expect("the service exited before listening").unwrap();
        if line.starts_with("listening on unix:") {
            break;
        }
    }
    std::thread::spawn(move || for _ in lines {});
    let mut server = Server { child, base: String::new() };
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "{mode:o}");
    let sock = socket.display().to_string();
    let reply =
        curl("http://localhost/v1/decode", Some(r#"{"model":"sd"}"#), Some(&models[0].2), &["--unix-socket", &sock]);
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.body, cli("decode", &models[0].1, &models[0].2, "out.npy", &[]));
    assert!(server.stop().success());
    assert!(!socket.exists(), "the socket was left behind");
}

#[test]
fn a_chunked_body_over_the_cap_is_413_and_a_broken_one_is_400() {
    use std::io::{Read as _, Write as _};
    let models: Vec<_> = families().into_iter().filter(|m| m.0 == "sd").collect();
    let mut args = model_flags(&models);
    args.extend(strings(&["--max-body", "64K"]));
    let server = Server::start(&args);
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("big.npy");
    write_npy(&big, &[1, 4, 96, 96]);
    // No Content-Length: the cap is found as the body arrives.
    let chunked = ["-H", "Transfer-Encoding: chunked"];
    let reply = curl(&server.url("/v1/decode"), Some(r#"{"model":"sd"}"#), Some(&big), &chunked);
    reply.assert_refused(413, "cap");
    // A chunk whose size is not hex: a bad request, not a body too large.
    let addr = server.base.strip_prefix("http://").unwrap();
    let mut conn = std::net::TcpStream::connect(addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let head = format!(
        "POST /v1/decode HTTP/1.1\r\nHost: {addr}\r\nX-VAE-Options: {{\"model\":\"sd\"}}\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nNUMP\r\nzz\r\n"
    );
    conn.write_all(head.as_bytes()).unwrap();
    let mut answer = Vec::new();
    let _ = conn.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("the request body could not be read"), "{answer}");
    // The service keeps serving.
    let small = curl(&server.url("/v1/decode"), Some(r#"{"model":"sd"}"#), Some(&models[0].2), &[]);
    assert_eq!(small.status, 200, "{}", small.text());
}
