//! The socket backend with real processes: the test binary re-runs itself once per rank
//! (`child_process_entry`), so every rank is a separate process with its own sockets.

#![allow(clippy::print_stdout)]

mod common;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use vae_transport::{Communicator, CommunicatorExt, SocketComm, TransportError};

const SCENARIO: &str = "VAE_TEST_SCENARIO";

/// The process side: joins the group from the environment and plays one scenario.
#[test]
#[ignore = "entry point of the rank processes that the socket tests spawn"]
fn child_process_entry() {
    let scenario = std::env::var(SCENARIO).expect("spawned by a socket test");
    let rank: usize = std::env::var("VAE_RANK").unwrap().parse().unwrap();
    if scenario == "rendezvous_rejected" {
        let err = SocketComm::from_env().expect_err("a world-size mismatch must fail the rendezvous");
        assert!(matches!(err, TransportError::Rendezvous(_)), "{err}");
        println!("REJECTED {err}");
        return;
    }
    // Lets a test talk to rank 0's listener before the other ranks join.
    if let Some(ms) = std::env::var("VAE_TEST_JOIN_DELAY_MS").ok().and_then(|v| v.parse::<u64>().ok())
        && rank > 0
    {
        std::thread::sleep(Duration::from_millis(ms));
    }
    let comm = SocketComm::from_env().expect("rendezvous");
    assert_eq!(comm.rank(), rank);
    match scenario.as_str() {
        "collectives" => common::exercise_all_collectives(&comm),
        "abort" => {
            if rank == 1 {
                comm.abort("tile 3 failed to decode");
            }
            let err = comm.barrier().expect_err("the group failed");
            assert_eq!(err.failed_rank(), Some(1), "{err}");
            if rank != 1 {
                assert!(err.to_string().contains("tile 3 failed to decode"), "{err}");
            }
        }
        "panic" => {
            if rank == 3 {
                panic!("rank 3 breaks on purpose");
            }
            let err = comm.all_gather(&[rank as u64]).expect_err("rank 3 panicked");
            assert!(matches!(err, TransportError::PeerFailed { rank: 3, .. }), "{err}");
            assert!(err.to_string().contains("panicked"), "{err}");
        }
        "victim" => {
            // Every rank reports ready; the victim then blocks until the parent kills or stops
            // it, the others wait for it in a barrier and must be told it failed.
            comm.barrier().unwrap();
            println!("READY");
            let victim: usize = std::env::var("VAE_TEST_VICTIM").unwrap().parse().unwrap();
            if rank == victim {
                std::thread::sleep(Duration::from_secs(120));
                return;
            }
            let waiting = Instant::now();
            let err = comm.barrier().expect_err("the victim never arrives");
            assert_eq!(err.failed_rank(), Some(victim), "{err}");
            println!("DETECTED after {:?}: {err}", waiting.elapsed());
        }
        "mismatch" => {
            let first =
                if rank == 0 { comm.broadcast(0, &mut vec![1u8; 8]) } else { comm.all_gather(&[2u8]).map(|_| ()) };
            let second = comm.barrier();
            assert!(first.is_err() || second.is_err(), "rank {rank} continued after a mismatch");
            assert!(second.is_err());
        }
        other => panic!("unknown scenario {other}"),
    }
}

static NEXT_ID: AtomicUsize = AtomicUsize::new(0);

fn unix_master(tag: &str) -> String {
    let n = NEXT_ID.fetch_add(1, Ordering::SeqCst);
    let path: PathBuf = std::env::temp_dir().join(format!("vae-t-{}-{tag}-{n}.sock", std::process::id()));
    format!("unix:{}", path.display())
}

fn tcp_master() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    format!("127.0.0.1:{port}")
}

struct Rank {
    child: Child,
    lines: mpsc::Receiver<String>,
    reader: std::thread::JoinHandle<()>,
}

/// The secret of the TCP groups these tests start (a Unix group may go without one).
const TEST_SECRET: &str = "5ea1ed5ea1ed5ea1ed5ea1ed5ea1ed5ea1ed5ea1ed5ea1ed5ea1ed5ea1ed5ea1";

fn spawn(scenario: &str, world: usize, master: &str, env: &[(&str, String)], worlds: Option<&[usize]>) -> Vec<Rank> {
    (0..worlds.map_or(world, <[usize]>::len))
        .map(|rank| {
            let claimed_world = worlds.map_or(world, |w| w[rank]);
            let mut cmd = common::rank_process("child_process_entry", SCENARIO, scenario, rank, claimed_world, master);
            if !master.starts_with("unix:") {
                cmd.env("VAE_GROUP_SECRET", TEST_SECRET);
            }
            for (k, v) in env {
                cmd.env(k, v);
            }
            let mut child = cmd.spawn().unwrap();
            let stdout = child.stdout.take().unwrap();
            let (tx, lines) = mpsc::channel();
            let reader = std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    let _ = tx.send(line);
                }
            });
            Rank { child, lines, reader }
        })
        .collect()
}

fn finish(rank: usize, r: Rank) -> (bool, String) {
    let output = r.child.wait_with_output().unwrap();
    let _ = r.reader.join(); // all of stdout has been read
    let mut text: Vec<String> = r.lines.try_iter().collect();
    text.push(String::from_utf8_lossy(&output.stderr).into_owned());
    (output.status.success(), format!("rank {rank}:\n{}", text.join("\n")))
}

fn run_all_ok(scenario: &str, world: usize, master: &str) {
    let ranks = spawn(scenario, world, master, &[], None);
    let outcomes: Vec<(bool, String)> = ranks.into_iter().enumerate().map(|(rank, r)| finish(rank, r)).collect();
    // "1 passed": the entry test really ran (a filter matching nothing also exits 0).
    if outcomes.iter().any(|(ok, text)| !ok || !text.contains("1 passed")) {
        let text: Vec<&str> = outcomes.iter().map(|(_, t)| t.as_str()).collect();
        panic!("{scenario} on {world} ranks at {master} failed:\n{}", text.join("\n"));
    }
}

#[test]
fn every_collective_on_one_to_eight_processes_over_unix_sockets() {
    for world in 1..=8 {
        run_all_ok("collectives", world, &unix_master("coll"));
    }
}

#[test]
fn every_collective_over_tcp() {
    for world in [2, 3, 5] {
        run_all_ok("collectives", world, &tcp_master());
    }
}

#[test]
fn an_aborting_rank_fails_every_process_with_its_reason() {
    run_all_ok("abort", 3, &unix_master("abort"));
}

#[test]
fn a_panicking_rank_fails_every_other_process() {
    let ranks = spawn("panic", 4, &unix_master("panic"), &[], None);
    for (rank, r) in ranks.into_iter().enumerate() {
        let (ok, text) = finish(rank, r);
        assert_eq!(ok, rank != 3, "{text}");
    }
}

#[test]
fn mismatched_collectives_fail_every_process() {
    run_all_ok("mismatch", 3, &tcp_master());
}

#[test]
fn a_world_size_disagreement_is_rejected_at_rendezvous() {
    let ranks = spawn("rendezvous_rejected", 0, &unix_master("rdv"), &[], Some(&[2, 3]));
    for (rank, r) in ranks.into_iter().enumerate() {
        let (ok, text) = finish(rank, r);
        assert!(ok, "{text}");
        assert!(text.contains("world size"), "{text}");
    }
}

/// Starts the victim scenario, waits until every rank is ready, hits the victim with `signal`,
/// and returns how long each survivor took to report the failure.
fn victim_run(master: &str, signal: &str, failure_timeout_s: &str) -> Vec<Duration> {
    let world = 4;
    let victim = 2;
    let env = [("VAE_TEST_VICTIM", victim.to_string()), ("VAE_FAILURE_TIMEOUT_S", failure_timeout_s.to_string())];
    let mut ranks = spawn("victim", world, master, &env, None);
    for (rank, r) in ranks.iter().enumerate() {
        loop {
            let line =
                r.lines.recv_timeout(Duration::from_secs(60)).unwrap_or_else(|_| panic!("rank {rank} never got ready"));
            if line == "READY" {
                break;
            }
        }
    }
    std::thread::sleep(Duration::from_millis(200)); // let the survivors block in the barrier
    let pid = ranks[victim].child.id().to_string();
    let hit = Instant::now();
    assert!(Command::new("kill").args([signal, &pid]).status().unwrap().success());
    let mut detection = Vec::new();
    for (rank, r) in ranks.iter_mut().enumerate() {
        if rank == victim {
            continue;
        }
        let status = r.child.wait().unwrap();
        detection.push(hit.elapsed());
        assert!(status.success(), "rank {rank} did not report the failed rank {victim}");
    }
    let mut victim_rank = ranks.remove(victim);
    let _ = victim_rank.child.kill();
    let _ = victim_rank.child.wait();
    detection
}

#[test]
fn a_killed_process_is_reported_to_every_other_rank_within_the_failure_timeout() {
    let detection = victim_run(&unix_master("kill"), "-KILL", "5");
    for d in &detection {
        assert!(*d < Duration::from_secs(5), "failure reported after {d:?}");
    }
    println!("killed rank reported after {detection:?}");
}

#[test]
fn a_hung_process_is_detected_by_missing_heartbeats() {
    // SIGSTOP keeps the sockets open: only the heartbeat window can tell.
    let detection = victim_run(&tcp_master(), "-STOP", "1");
    for d in &detection {
        assert!(*d < Duration::from_secs(5), "silent rank reported after {d:?}");
        assert!(*d >= Duration::from_millis(500), "reported before the heartbeat window could pass: {d:?}");
    }
    println!("stopped rank reported after {detection:?}");
}

#[test]
fn foreign_and_silent_connections_do_not_break_the_rendezvous() {
    use std::io::Write;
    let master = tcp_master();
    // Ranks 1 and 2 join 2 s late, so the clients below reach rank 0 before the group is complete.
    let env = [("VAE_FAILURE_TIMEOUT_S", "1".to_string()), ("VAE_TEST_JOIN_DELAY_MS", "2000".to_string())];
    let ranks = spawn("collectives", 3, &master, &env, None);
    // Before the ranks join: a client announcing a 1 TiB frame, and one that says nothing.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut silent = None;
    while Instant::now() < deadline {
        if let Ok(mut s) = std::net::TcpStream::connect(&master) {
            let mut header = [0u8; 32];
            header[0..4].copy_from_slice(b"VAEF");
            header[4] = 32; // hello
            header[24..32].copy_from_slice(&(1u64 << 40).to_le_bytes());
            let _ = s.write_all(&header);
            silent = std::net::TcpStream::connect(&master).ok();
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(silent.is_some(), "the master never listened");
    let outcomes: Vec<(bool, String)> = ranks.into_iter().enumerate().map(|(rank, r)| finish(rank, r)).collect();
    for (ok, text) in &outcomes {
        assert!(*ok && text.contains("1 passed"), "{text}");
    }
}

#[test]
fn a_unix_master_path_that_is_a_regular_file_is_refused_not_deleted() {
    let path = std::env::temp_dir().join(format!("vae-t-{}-not-a-socket", std::process::id()));
    std::fs::write(&path, b"precious").unwrap();
    let options = vae_transport::SocketOptions {
        rank: 0,
        world_size: 2,
        master: format!("unix:{}", path.display()).parse().unwrap(),
        config: vae_transport::TransportConfig { connect_timeout: Duration::from_secs(1), ..Default::default() },
        secret: None,
    };
    let err = SocketComm::connect(&options).unwrap_err();
    assert!(matches!(err, TransportError::Rendezvous(_)), "{err}");
    assert_eq!(std::fs::read(&path).unwrap(), b"precious");
    std::fs::remove_file(&path).unwrap();
}

/// A hello frame claiming `rank` of a group of `world`, as a process without the secret would
/// send it (the handshake's first frame would be a challenge).
fn forged_hello(rank: u64, world: u64) -> Vec<u8> {
    let mut payload = Vec::new();
    for word in [1u64, 1, world, rank] {
        payload.extend_from_slice(&word.to_le_bytes());
    }
    payload.extend_from_slice(&0u64.to_le_bytes()); // an empty address
    let mut frame = vec![0u8; 32];
    frame[0..4].copy_from_slice(b"VAEF");
    frame[4] = 32; // hello
    frame[24..32].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    frame.extend_from_slice(&payload);
    frame
}

/// Strangers reach rank 0 before the real ranks: one claims rank 1 with a well-formed hello
/// and no proof, one trickles a byte every half second, one holds another secret. None gets
/// in, none fails or holds up the group, which computes its collectives as usual.
#[test]
fn strangers_without_the_secret_never_join_and_never_break_the_group() {
    use std::io::{Read, Write};
    let master = tcp_master();
    let env = [("VAE_TEST_JOIN_DELAY_MS", "2500".to_string())];
    let ranks = spawn("collectives", 3, &master, &env, None);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut forged = loop {
        if let Ok(s) = std::net::TcpStream::connect(&master) {
            break s;
        }
        assert!(Instant::now() < deadline, "the master never listened");
        std::thread::sleep(Duration::from_millis(5));
    };
    forged.write_all(&forged_hello(1, 3)).unwrap();
    let trickle = std::thread::spawn({
        let master = master.clone();
        move || {
            let mut s = std::net::TcpStream::connect(&master).unwrap();
            for b in b"VAEF\x24" {
                if s.write_all(&[*b]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(500));
            }
        }
    });
    // A process with another secret, as rank 2: refused by the check of rank 0's answer.
    let mut impostor = common::rank_process("child_process_entry", SCENARIO, "rendezvous_rejected", 2, 3, &master);
    impostor.env("VAE_GROUP_SECRET", "00".repeat(32));
    let impostor = impostor.spawn().unwrap();
    let started = Instant::now();
    let outcomes: Vec<(bool, String)> = ranks.into_iter().enumerate().map(|(rank, r)| finish(rank, r)).collect();
    for (ok, text) in &outcomes {
        assert!(*ok && text.contains("1 passed"), "{text}");
    }
    assert!(started.elapsed() < Duration::from_secs(25), "the group took {:?}", started.elapsed());
    // The forged hello was never answered with the group's table: rank 0 closed the link.
    let mut rest = Vec::new();
    let _ = forged.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = forged.read_to_end(&mut rest);
    assert!(rest.is_empty(), "rank 0 answered a stranger: {rest:?}");
    let output = impostor.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success() && text.contains("does not hold this group's secret"), "{text}");
    trickle.join().unwrap();
}

#[test]
fn a_tcp_group_without_a_secret_refuses_to_start() {
    let options = vae_transport::SocketOptions {
        rank: 1,
        world_size: 2,
        master: tcp_master().parse().unwrap(),
        config: vae_transport::TransportConfig::default(),
        secret: None,
    };
    if std::env::var("VAE_INSECURE_NO_AUTH").is_ok() {
        return; // the environment opts out; nothing to check
    }
    let err = SocketComm::connect(&options).unwrap_err();
    assert!(matches!(err, TransportError::InvalidArgument(_)), "{err}");
    assert!(err.to_string().contains("VAE_GROUP_SECRET"), "{err}");
}
