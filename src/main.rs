//! The `turnstile` binary: parse arguments, set up logging, start the gateway, wire signals.

use std::io::{IsTerminal, Write as _};
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use turnstile::config;
use turnstile::metrics::Metrics;

#[derive(Parser)]
#[command(name = "turnstile", version, about = "HTTP rate-limit gateway")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve: the public proxy listener and the admin listener.
    Run {
        /// The policies file.
        #[arg(long, short, env = "TURNSTILE_CONFIG", default_value = "policies.yaml")]
        config: PathBuf,
        /// Worker threads [default: the CPUs this process may use]. With 1, everything runs on
        /// one thread, as one NGINX worker does.
        #[arg(long, env = "TURNSTILE_WORKERS")]
        workers: Option<NonZeroUsize>,
    },
    /// Validate a policies file: exit 0 when valid, else print FILE:LINE:COL errors and exit 1.
    Check {
        #[arg(long, short, env = "TURNSTILE_CONFIG", default_value = "policies.yaml")]
        config: PathBuf,
    },
    /// Exit 0 when a running gateway is ready (its admin listener's /readyz answers 2xx), else
    /// print why and exit 1: a container health check for an image with no shell or curl.
    Healthcheck {
        #[arg(long, env = "TURNSTILE_HEALTHCHECK_URL", default_value = turnstile::probe::DEFAULT_URL)]
        url: String,
        /// How long to wait for the answer.
        #[arg(long, default_value = "2s", value_parser = parse_timeout)]
        timeout: std::time::Duration,
    },
    /// Translate another gateway's configuration into a policies file (docs/migration.md).
    #[command(subcommand)]
    Import(Import),
    /// Serve the Envoy rate limit service as envoyproxy/ratelimit does, configured by its
    /// environment variables (RUNTIME_ROOT, GRPC_PORT, GRPC_SERVER_USE_TLS, REDIS_URL...): a
    /// drop-in for its Deployment (docs/envoy.md). A binary named `ratelimit` runs this.
    Ratelimit {
        #[arg(long, env = "TURNSTILE_WORKERS")]
        workers: Option<NonZeroUsize>,
    },
}

#[derive(Subcommand)]
enum Import {
    /// Kubernetes Ingress manifests with ingress-nginx annotations: the policies file on stdout
    /// (or -o), a report of everything not mapped exactly on stderr.
    IngressNginx {
        /// Manifest files (multi-document YAML; `-` reads stdin).
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Write the policies file here instead of stdout.
        #[arg(long, short)]
        output: Option<PathBuf>,
        /// Only the Ingresses of this class (`spec.ingressClassName`, else the
        /// `kubernetes.io/ingress.class` annotation); the others are skipped and reported.
        #[arg(long, value_name = "NAME")]
        ingress_class: Option<String>,
        /// With --ingress-class, also the Ingresses that name no class (skipped otherwise, as
        /// ingress-nginx does without this flag).
        #[arg(long, requires = "ingress_class")]
        watch_ingress_without_class: bool,
    },
}

fn parse_timeout(text: &str) -> Result<std::time::Duration, String> {
    config::units::parse_duration(text)
}

fn main() -> ExitCode {
    // Envoy Gateway's Deployment runs `/bin/ratelimit` with no arguments.
    let as_ratelimit = std::env::args_os()
        .next()
        .is_some_and(|arg0| Path::new(&arg0).file_name() == Some("ratelimit".as_ref()));
    let cli = if as_ratelimit {
        Cli {
            command: Command::Ratelimit { workers: None },
        }
    } else {
        Cli::parse()
    };
    match cli.command {
        Command::Check { config } => match config::load(&config) {
            Ok(snapshot) => {
                for warning in &snapshot.warnings {
                    eprintln!("warning: {warning}");
                }
                println!(
                    "{}: ok ({} routes)",
                    config.display(),
                    snapshot.routes.len()
                );
                ExitCode::SUCCESS
            }
            Err(errors) => {
                eprintln!("{errors}");
                ExitCode::FAILURE
            }
        },
        Command::Import(Import::IngressNginx {
            files,
            output,
            ingress_class,
            watch_ingress_without_class,
        }) => {
            let options = turnstile::import::Options {
                ingress_class,
                without_class: watch_ingress_without_class,
            };
            match import_ingress_nginx(&files, output.as_deref(), &options) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("turnstile import: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Healthcheck { url, timeout } => match turnstile::probe::ready(&url, timeout) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("turnstile healthcheck: {e}");
                ExitCode::FAILURE
            }
        },
        Command::Run { config, workers } => serve(config, workers, "info"),
        Command::Ratelimit { workers } => {
            let made = match config::ratelimit_env::from_env(&|name| std::env::var(name).ok()) {
                Ok(made) => made,
                Err(e) => {
                    eprintln!("turnstile ratelimit: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let path = match write_generated(&made.yaml) {
                Ok(path) => path,
                Err(e) => {
                    eprintln!("turnstile ratelimit: {e:#}");
                    return ExitCode::FAILURE;
                }
            };
            for (name, why) in &made.ignored {
                eprintln!("turnstile ratelimit: {name} has no effect: {why}");
            }
            // envoyproxy/ratelimit's LOG_LEVEL (debug, info, warn, error), unless TURNSTILE_LOG.
            let level = std::env::var("LOG_LEVEL")
                .ok()
                .map(|l| l.to_ascii_lowercase())
                .filter(|l| ["trace", "debug", "info", "warn", "error"].contains(&l.as_str()))
                .unwrap_or_else(|| "info".to_string());
            serve(path, workers, &level)
        }
    }
}

/// Writes the policies file `turnstile ratelimit` made into `TURNSTILE_RATELIMIT_DIR` (default: a
/// directory of this process under the temp dir), where SIGHUP re-reads it.
fn write_generated(yaml: &str) -> anyhow::Result<PathBuf> {
    let dir = std::env::var_os("TURNSTILE_RATELIMIT_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            std::env::temp_dir().join(format!("turnstile-ratelimit-{}", std::process::id()))
        });
    std::fs::create_dir_all(&dir).with_context(|| {
        format!(
            "cannot create {} for the generated config (set TURNSTILE_RATELIMIT_DIR)",
            dir.display()
        )
    })?;
    let path = dir.join("policies.yaml");
    std::fs::write(&path, yaml).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(path)
}

/// `turnstile run`: logging, the runtime, then the gateway until SIGTERM.
fn serve(config: PathBuf, workers: Option<NonZeroUsize>, level: &str) -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TURNSTILE_LOG")
                // The h2 crate warns once per connection it closes for a reset flood;
                // the listener counts and logs those, throttled.
                .unwrap_or_else(|_| format!("{level},h2=error").into()),
        )
        .with_writer(std::io::stderr)
        // Colour codes only for a terminal, never into log files or collectors.
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let workers = workers
        .unwrap_or_else(|| std::thread::available_parallelism().unwrap_or(NonZeroUsize::MIN));
    let runtime = match runtime(workers) {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("turnstile: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    // Several workers: each connection lives on one thread of its own (`turnstile::workers`).
    if workers.get() > 1 {
        if let Err(e) = turnstile::workers::start(workers.get(), read_clock) {
            eprintln!("turnstile: cannot start the connection workers: {e}");
            return ExitCode::FAILURE;
        }
    }
    match runtime.block_on(run(config, workers)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("turnstile: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Reads the manifests, checks the generated config with the same loader as `check` (a failure
/// there is a bug of the importer, never written out), then writes it and the report.
fn import_ingress_nginx(
    files: &[PathBuf],
    output: Option<&Path>,
    options: &turnstile::import::Options,
) -> anyhow::Result<()> {
    let mut inputs = Vec::with_capacity(files.len());
    for file in files {
        let text = if file.as_os_str() == "-" {
            std::io::read_to_string(std::io::stdin()).context("cannot read stdin")?
        } else {
            std::fs::read_to_string(file)
                .with_context(|| format!("cannot read {}", file.display()))?
        };
        inputs.push((file.display().to_string(), text));
    }
    let imported = turnstile::import::ingress_nginx_with(&inputs, options)?;
    let name = output.unwrap_or(Path::new("policies.yaml"));
    config::parse(&imported.yaml, name).map_err(|e| {
        anyhow::anyhow!("the generated config does not pass check (an importer bug):\n{e}")
    })?;
    match output {
        Some(path) => std::fs::write(path, &imported.yaml)
            .with_context(|| format!("cannot write {}", path.display()))?,
        None => std::io::stdout()
            .write_all(imported.yaml.as_bytes())
            .context("cannot write stdout")?,
    }
    eprint!("{}", imported.report());
    Ok(())
}

/// One worker gets tokio's single-threaded scheduler: with no other worker to steal from, the
/// work-stealing one only adds cost (cross-thread wake-ups, and a LIFO slot that lets a woken task
/// jump the queue). In `bench/run.sh` that cost was 7% of throughput and 20% on p99.
fn runtime(workers: NonZeroUsize) -> std::io::Result<tokio::runtime::Runtime> {
    let mut builder = if workers.get() == 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut builder = tokio::runtime::Builder::new_multi_thread();
        builder.worker_threads(workers.get());
        builder
    };
    builder.on_thread_unpark(read_clock).enable_all().build()
}

/// A thread that wakes reads the clock once for whatever it runs next (`turnstile::now`).
fn read_clock() {
    turnstile::now::read();
}

async fn run(path: PathBuf, workers: NonZeroUsize) -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};

    // Handlers first: until they exist, SIGHUP, SIGTERM and SIGINT kill the process outright, and
    // whoever reads the line below may signal at once.
    let mut hangup = signal(SignalKind::hangup())?;
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut user1 = signal(SignalKind::user_defined1())?;

    // Before the load: a change made while the file is being read is then seen as a change.
    let mut watcher = turnstile::watch::ConfigWatcher::new(&path);
    let metrics = Metrics::new();
    let snapshot = config::load(&path).map_err(|e| anyhow::anyhow!("{e}"))?;
    for warning in &snapshot.warnings {
        tracing::warn!("{warning}");
    }
    let running = turnstile::start(snapshot, metrics, None)
        .await
        .context("cannot start listeners")?;
    // One line, machine-readable: tests and scripts that bind port 0 read the real addresses here.
    let public = running
        .public_addr
        .map_or_else(|| "off".to_string(), |addr| addr.to_string());
    let mut line = format!(
        "turnstile listening public={public} admin={}",
        running.admin_addr
    );
    for (name, addr) in [
        ("tls", running.tls_addr),
        ("rls", running.rls_addr),
        ("forward_auth", running.forward_auth_addr),
        ("ext_authz", running.ext_authz_addr),
    ] {
        if let Some(addr) = addr {
            line.push_str(&format!(" {name}={addr}"));
        }
    }
    println!("{line}");
    tracing::info!(
        %public,
        admin = %running.admin_addr,
        workers,
        "turnstile started"
    );

    tracing::debug!(?watcher, "watching the config file");
    let mut overrides = OverridesWatch::default();
    overrides.follow(&running);
    loop {
        tokio::select! {
            // Parsing runs on the blocking pool: with one worker, it would otherwise hold up
            // every request while it reads and validates the files.
            _ = hangup.recv() => reload(&running, "SIGHUP").await,
            // Kubernetes ConfigMaps, saves by rename and edits in place: no signal arrives.
            _ = watcher.changed() => reload(&running, "file change").await,
            _ = overrides.changed() => reload(&running, "overrides file change").await,
            // logrotate renamed the access log: write on in a fresh file of its name.
            _ = user1.recv() => running.state.access_log.reopen(),
            _ = terminate.recv() => break,
            _ = interrupt.recv() => break,
        }
        overrides.follow(&running);
    }
    tracing::info!("shutting down: draining in-flight requests");
    running.shutdown().await;
    Ok(())
}

/// The watch on the overrides file that the serving config names. The file is read with the
/// config, before the watch on it begins, so each watch starts from the bytes that load read: an
/// edit in between applies at once.
#[derive(Default)]
struct OverridesWatch(Option<turnstile::watch::ConfigWatcher>);

impl OverridesWatch {
    /// Moves the watch to the file the serving config names, after a reload that named another
    /// (or none). A failed reload leaves the serving config, and so the watch, as they were.
    fn follow(&mut self, running: &turnstile::Running) {
        let live = running.state.live.load();
        let config = &live.config;
        let named = config.overrides_file.as_deref();
        if self.0.as_ref().map(|watcher| watcher.path()) == named {
            return;
        }
        self.0 = named.map(|file| {
            let watcher = turnstile::watch::ConfigWatcher::since(file, config.overrides_sha256);
            tracing::debug!(?watcher, "watching the overrides file");
            watcher
        });
    }

    async fn changed(&mut self) {
        match self.0.as_mut() {
            Some(watcher) => watcher.changed().await,
            None => std::future::pending().await,
        }
    }
}

/// Reloads on the blocking pool (parsing must not hold up a single worker); success is logged
/// with what changed by the reload itself.
async fn reload(running: &turnstile::Running, why: &str) {
    if let Err(e) = running.reload().await {
        tracing::error!(
            trigger = why,
            "config reload failed; the running config stays:\n{e}"
        );
    }
}
