//! `vae-parallel serve`: a VAE service over HTTP. The group (local ranks, rank processes it
//! launches, or ranks the environment placed) and every model's weights stay loaded; rank 0 (this
//! process) takes requests over HTTP and every rank runs them in arrival order, one at a time.
//!
//! Pieces: [`spec`] (a request's options and the frame rank 0 broadcasts), [`engine`] (the
//! group's thread and its bounded queue), [`ranks`] (forming, rebuilding and stopping the group),
//! [`http`] (the routes), [`metrics`] (Prometheus text). docs/serving.md is the user's guide.

mod engine;
mod http;
mod metrics;
mod ranks;
mod spec;

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;

use crate::Vae;
use crate::cli::model_cmds::ParallelFlags;
use crate::launch::is_rank_process;
use crate::settings::Settings;

/// Options of `serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// A model to serve, `NAME=DIR` (a diffusers VAE directory); repeat for several. Clients
    /// name models by NAME only.
    #[arg(long = "model", value_name = "NAME=DIR", required = true)]
    models: Vec<String>,
    /// Where to listen: `HOST:PORT` (port 0 picks a free one; the address is printed) or
    /// `unix:/path`. Any address but loopback or a Unix socket needs --token-file.
    #[arg(long, default_value = "127.0.0.1:8000")]
    listen: String,
    /// A file holding the bearer token every request (but /healthz and /readyz) must carry.
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// Requests that may wait for the group beyond the one running; more are answered 429. At
    /// most this many + 1 request bodies are read into memory at once; more are answered 429
    /// before their body is read.
    #[arg(long, default_value_t = 16)]
    queue: usize,
    /// The largest request body: bytes, or a number with K, M or G.
    #[arg(long, default_value = "256M")]
    max_body: String,
    /// Seconds a request's headers, and then its body, may take to arrive; and the longest a
    /// stream of frames waits for its client to take the next chunk before the request fails.
    #[arg(long, default_value_t = 30)]
    read_timeout_s: u64,
    /// Seconds SIGTERM or ctrl-c leaves the requests in flight to finish before they are
    /// cancelled.
    #[arg(long, default_value_t = 30)]
    grace_s: u64,
    #[command(flatten)]
    parallel: ParallelFlags,
}

/// `vae-parallel serve`.
pub fn serve(args: &ServeArgs) -> anyhow::Result<ExitCode> {
    let file = match args.parallel.config() {
        Some(path) => Settings::from_toml_file(path)?,
        None => Settings::default(),
    };
    let base = args.parallel.flags().or(file);
    let settings = args.parallel.settings()?;
    let names = model_names(&args.models)?;
    if settings.transport.is_multi_process() && is_rank_process() {
        let rank = crate::transport::SocketOptions::from_env()?.rank;
        if rank != 0 {
            // One of the other ranks: no HTTP, only the requests rank 0 broadcasts.
            let group = ranks::join(settings.transport, &crate::transport::SocketOptions::from_env()?)?;
            let models = load_models(&names, &settings, ranks::rank_device(&settings, group.rank()))?;
            ranks::rank_loop(&group, &models, &base)?;
            return Ok(ExitCode::SUCCESS);
        }
    }
    // The address and the token are checked before anything is loaded.
    let listen = Listen::parse(&args.listen)?;
    let token = match &args.token_file {
        Some(path) => Some(read_token(path)?),
        None if listen.is_private() => None,
        None => bail!(
            "--listen {} is reachable from other hosts: pass --token-file (or listen on loopback or unix:/path)",
            args.listen
        ),
    };
    let max_body = usize::try_from(crate::settings::parse_memory(&args.max_body).map_err(|e| {
        anyhow::anyhow!(crate::settings::rename_options(&e.to_string(), |_| Some("--max-body".into())))
    })?)?;
    if args.queue == 0 {
        bail!("--queue must be at least 1");
    }
    let models = Arc::new(load_models(&names, &settings, ranks::rank_device(&settings, 0))?);
    let models_json = models_json(&models, &settings);
    let forwarded: Vec<_> = std::env::args_os().skip(1).collect();
    let group = ranks::ServiceGroup::start(&settings, forwarded)?;
    let described = group.describe();
    let (engine, thread) = engine::start(group, Arc::clone(&models), base.clone(), args.queue);
    let app = Arc::new(http::App::new(
        engine.clone(),
        models,
        models_json,
        base,
        token,
        max_body,
        Duration::from_secs(args.read_timeout_s),
        args.queue,
    ));
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let timeout = Duration::from_secs(args.read_timeout_s);
    let grace = Duration::from_secs(args.grace_s);
    let served = runtime.block_on(run_http(listen, Arc::clone(&app), timeout, grace, &described));
    // Stop the group: what waits is answered, the ranks leave, none is left behind.
    engine.stop.store(true, Ordering::Relaxed);
    drop(app);
    // The connections were drained (or given up on) above. Dropping what is left of them first
    // closes every stream of frames and cancels every request still admitted, so that the
    // group's thread, which may be sending frames, is never waited on for a client.
    runtime.shutdown_background();
    let _ = thread.join();
    served?;
    Ok(ExitCode::SUCCESS)
}

/// The models' names and directories from `NAME=DIR`, names unique and plain.
fn model_names(specs: &[String]) -> anyhow::Result<Vec<(String, PathBuf)>> {
    let mut out: Vec<(String, PathBuf)> = Vec::new();
    for spec in specs {
        let Some((name, dir)) = spec.split_once('=') else { bail!("--model {spec:?} must be NAME=DIR") };
        let plain = !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
        if !plain {
            bail!("--model {spec:?}: the name must be letters, digits, '-', '_' or '.'");
        }
        if out.iter().any(|(n, _)| n == name) {
            bail!("--model: the name {name:?} is given twice");
        }
        out.push((name.to_string(), PathBuf::from(dir)));
    }
    Ok(out)
}

fn load_models(
    names: &[(String, PathBuf)],
    settings: &crate::settings::Resolved,
    device: crate::Device,
) -> anyhow::Result<Vec<(String, Vae)>> {
    names
        .iter()
        .map(|(name, dir)| {
            let vae = settings.vae_builder(dir, device).build().with_context(|| format!("loading --model {name}"))?;
            vae.check_mode(settings.options.mode).with_context(|| format!("--model {name}"))?;
            Ok((name.clone(), vae))
        })
        .collect()
}

/// `GET /v1/models`: each model's name, class, families, device, element type, modes, whether it
/// streams, and what `inspect` says of it.
fn models_json(models: &[(String, Vae)], settings: &crate::settings::Resolved) -> String {
    let list: Vec<serde_json::Value> = models
        .iter()
        .map(|(name, vae)| {
            let describe: serde_json::Map<String, serde_json::Value> =
                vae.model().describe().into_iter().map(|(k, v)| (k.to_string(), v.into())).collect();
            serde_json::json!({
                "name": name,
                "class": vae.class_name(),
                "families": vae.model().models(),
                "device": vae.device().to_string(),
                "dtype": if settings.tf32 { "tf32".to_string() } else { vae.compute_dtype().to_string() },
                "modes": vae.supported_modes().iter().map(ToString::to_string).collect::<Vec<_>>(),
                "streams": vae.streams(),
                "can": ["decode", "encode"],
                "describe": describe,
            })
        })
        .collect();
    serde_json::json!({ "models": list }).to_string()
}

/// The token from its file (trimmed); an empty one is refused.
fn read_token(path: &std::path::Path) -> anyhow::Result<Vec<u8>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("--token-file {}", path.display()))?;
    let token = text.trim();
    if token.is_empty() {
        bail!("--token-file {} is empty", path.display());
    }
    Ok(token.as_bytes().to_vec())
}

/// Where the service listens.
enum Listen {
    Tcp(Vec<SocketAddr>),
    Unix(PathBuf),
}

impl Listen {
    fn parse(text: &str) -> anyhow::Result<Self> {
        if let Some(path) = text.strip_prefix("unix:") {
            return Ok(Self::Unix(PathBuf::from(path)));
        }
        let addrs: Vec<SocketAddr> = text
            .to_socket_addrs()
            .with_context(|| format!("--listen {text:?} is not HOST:PORT or unix:/path"))?
            .collect();
        if addrs.is_empty() {
            bail!("--listen {text:?} names no address");
        }
        Ok(Self::Tcp(addrs))
    }

    /// Loopback or a Unix socket: reachable from this host only.
    fn is_private(&self) -> bool {
        match self {
            Self::Tcp(addrs) => addrs.iter().all(|a| a.ip().is_loopback()),
            Self::Unix(_) => true,
        }
    }
}

/// Serves until SIGTERM or ctrl-c, then stops accepting and gives the requests in flight
/// `grace` to finish (cancelling them after it).
#[allow(clippy::print_stdout)]
async fn run_http(
    listen: Listen,
    app: Arc<http::App>,
    read_timeout: Duration,
    grace: Duration,
    described: &str,
) -> anyhow::Result<()> {
    use std::io::Write as _;
    let router = http::router(Arc::clone(&app));
    let graceful = GracefulShutdown::new();
    let mut stop = Box::pin(shutdown_signal());
    enum Listener {
        Tcp(tokio::net::TcpListener),
        Unix(tokio::net::UnixListener, PathBuf),
    }
    let listener = match &listen {
        Listen::Tcp(addrs) => {
            let l = tokio::net::TcpListener::bind(addrs.as_slice()).await.context("--listen")?;
            println!("listening on http://{}", l.local_addr()?);
            Listener::Tcp(l)
        }
        Listen::Unix(path) => {
            remove_stale_socket(path)?;
            let l =
                tokio::net::UnixListener::bind(path).with_context(|| format!("--listen unix:{}", path.display()))?;
            // This user's only: a Unix socket carries no token check when --token-file is unset.
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
                .with_context(|| format!("--listen unix:{}: setting its permissions", path.display()))?;
            println!("listening on unix:{}", path.display());
            Listener::Unix(l, path.clone())
        }
    };
    println!("serving {} model(s) on {described}", app.models.len());
    let _ = std::io::stdout().flush();
    let serve_one = |io| {
        let service = TowerToHyperService::new(router.clone());
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder.timer(TokioTimer::new()).header_read_timeout(read_timeout);
        let conn = builder.serve_connection(io, service);
        let watched = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = watched.await;
        });
    };
    loop {
        tokio::select! {
            _ = &mut stop => break,
            accepted = async {
                match &listener {
                    Listener::Tcp(l) => l.accept().await.map(|(s, _)| Conn::Tcp(s)),
                    Listener::Unix(l, _) => l.accept().await.map(|(s, _)| Conn::Unix(s)),
                }
            } => match accepted {
                Ok(Conn::Tcp(s)) => serve_one(TokioIo::new(Box::new(s) as Box<dyn Io>)),
                Ok(Conn::Unix(s)) => serve_one(TokioIo::new(Box::new(s) as Box<dyn Io>)),
                Err(e) => tracing::warn!("accepting a connection: {e}"),
            },
        }
    }
    // Stop accepting; unready, so that a load balancer sends no more.
    app.engine.ready.store(false, Ordering::Relaxed);
    if let Listener::Unix(_, path) = &listener {
        let _ = std::fs::remove_file(path);
    }
    drop(listener);
    tracing::warn!("stopping: the requests in flight have {} s to finish", grace.as_secs());
    if tokio::time::timeout(grace, graceful.shutdown()).await.is_err() {
        app.cancel_all("the service is stopping");
        tracing::warn!("the grace period ran out: the requests still in flight were cancelled");
    }
    Ok(())
}

/// Removes the socket a service that did not stop cleanly left at `path`; anything there but a
/// socket is an error (never removed).
fn remove_stale_socket(path: &std::path::Path) -> anyhow::Result<()> {
    use std::os::unix::fs::FileTypeExt as _;
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("--listen unix:{}", path.display())),
        Ok(meta) if meta.file_type().is_socket() => {
            tracing::warn!("removing the stale socket {}", path.display());
            std::fs::remove_file(path)
                .with_context(|| format!("--listen unix:{}: removing the stale socket", path.display()))
        }
        Ok(_) => bail!("--listen unix:{}: the path exists and is not a socket", path.display()),
    }
}

/// A connection's stream, TCP or Unix.
trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static> Io for T {}

enum Conn {
    Tcp(tokio::net::TcpStream),
    Unix(tokio::net::UnixStream),
}

/// SIGTERM or ctrl-c.
async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
    }
}
