//! Reloads as operators cause them, on the real binary under load: a Kubernetes ConfigMap's
//! `..data` symlink swap, a save by rename, an edit in place, a broken file and a good one after it.
//! No signal is sent. Every change must apply within 2 seconds, no request may fail, a broken file
//! must leave the running config serving (and say why on `/config`), and counters of policies that
//! did not change must carry over. Also `turnstile healthcheck`, the container health probe.

mod support;

use std::os::unix::fs::symlink;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::{metric, process::BINARY, Client, GatewayProcess, Upstream};

/// The bound the watcher promises for a change to be serving.
const APPLY_WITHIN: Duration = Duration::from_secs(2);

fn config(upstream: &str, marker: &str) -> String {
    format!(
        "listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
upstreams:
  api: {{url: 'http://{upstream}'}}
routes:
  - name: marker
    match: {{path: /marker}}
    respond: {{body: '{marker}'}}
  - name: steady
    match: {{prefix: /steady}}
    upstream: api
    policies:
      - name: roomy
        key: [client_ip]
        token_bucket: {{rate: 1/s, burst: 1000000}}
  - name: carry
    match: {{path: /carry}}
    respond: {{body: carry}}
    policies:
      - name: ten
        key: [client_ip]
        token_bucket: {{rate: 1/h, burst: 10}}
"
    )
}

/// Writes version `version` of the ConfigMap volume and swaps `..data` to it, as the kubelet does.
fn configmap_swap(dir: &Path, version: &str, content: &str) {
    let versioned = dir.join(version);
    std::fs::create_dir_all(&versioned).expect("mkdir");
    std::fs::write(versioned.join("policies.yaml"), content).expect("write");
    let tmp = dir.join("..data_tmp");
    let _ = std::fs::remove_file(&tmp);
    symlink(version, &tmp).expect("symlink");
    std::fs::rename(&tmp, dir.join("..data")).expect("swap ..data");
    let link = dir.join("policies.yaml");
    if std::fs::symlink_metadata(&link).is_err() {
        symlink("..data/policies.yaml", &link).expect("symlink");
    }
}

/// Replaces `path` by writing a sibling and renaming it over, as editors save.
fn save_by_rename(path: &Path, content: &str) {
    let tmp = path.with_extension("yaml.swp");
    std::fs::write(&tmp, content).expect("write");
    std::fs::rename(&tmp, path).expect("rename");
}

/// Polls `/marker` until it says `want`; returns how long that took.
async fn visible_after(
    gw: &GatewayProcess,
    client: &Client,
    want: &str,
    since: Instant,
) -> Duration {
    loop {
        let reply = client.get(&gw.url("/marker")).await;
        if reply.text() == want {
            return since.elapsed();
        }
        assert!(
            since.elapsed() < Duration::from_secs(15),
            "`{want}` never served; log:\n{}",
            gw.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_of_file_change_applies_under_load_with_no_failed_request() {
    let upstream = Upstream::start().await;
    let up = upstream.addr.to_string();
    let dir = tempfile::tempdir().expect("tempdir");
    let root = std::fs::canonicalize(dir.path()).expect("canonical");
    configmap_swap(&root, "..2026_11_22_v1", &config(&up, "v1"));
    let path = root.join("policies.yaml");
    let gw = GatewayProcess::spawn_at(dir, path.clone(), &[]).await;
    let client = Client::new();

    // Consume 4 of the `carry` policy's 10 before any reload.
    for _ in 0..4 {
        assert_eq!(client.get(&gw.url("/carry")).await.status, 200);
    }

    // Bounded keep-alive load through the upstream for the whole test.
    let stop = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let first_failure = Arc::new(std::sync::Mutex::new(None::<String>));
    let mut load = Vec::new();
    for _ in 0..4 {
        let (stop, ok, failed, first_failure) = (
            stop.clone(),
            ok.clone(),
            failed.clone(),
            first_failure.clone(),
        );
        let url = gw.url("/steady");
        let client = Client::new();
        load.push(tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(60);
            for _ in 0..200_000 {
                if stop.load(Ordering::Relaxed) || Instant::now() > deadline {
                    break;
                }
                match client.try_get(&url).await {
                    Ok(reply) if reply.status == 200 => {
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                    other => {
                        failed.fetch_add(1, Ordering::Relaxed);
                        let mut first = first_failure.lock().expect("lock");
                        if first.is_none() {
                            *first = Some(format!("{:?}", other.map(|r| r.status)));
                        }
                    }
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;

    // 1. The kubelet's swap of `..data`.
    let t = Instant::now();
    configmap_swap(&root, "..2026_11_22_v2", &config(&up, "v2"));
    let swap = visible_after(&gw, &client, "v2", t).await;

    // 2. A save by rename, in the directory the chain resolves to.
    let t = Instant::now();
    let real = root.join("..2026_11_22_v2/policies.yaml");
    save_by_rename(&real, &config(&up, "v3"));
    let rename = visible_after(&gw, &client, "v3", t).await;

    // 3. An edit in place (same inode).
    let t = Instant::now();
    {
        use std::io::{Seek, Write};
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .open(&real)
            .expect("open in place");
        let text = config(&up, "v4");
        file.set_len(0).expect("truncate");
        file.seek(std::io::SeekFrom::Start(0)).expect("seek");
        file.write_all(text.as_bytes()).expect("write in place");
    }
    let in_place = visible_after(&gw, &client, "v4", t).await;

    // 4. A broken file: the running config stays, ready, and `/config` says why.
    let broken = config(&up, "v5").replace("rate: 1/h", "rate: often");
    configmap_swap(&root, "..2026_11_22_v3", &broken);
    let t = Instant::now();
    let status = loop {
        let status = client.get(&gw.admin_url("/config")).await.json();
        if !status["last_reload_error"].is_null() {
            break status;
        }
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "no reload error reported"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let error = status["last_reload_error"].as_str().expect("error text");
    assert!(
        error.contains("policies.yaml:")
            && error.contains("routes[2].policies[0].token_bucket.rate"),
        "the error names file, line and field: {error}"
    );
    assert_eq!(client.get(&gw.url("/marker")).await.text(), "v4");
    assert_eq!(client.get(&gw.admin_url("/readyz")).await.status, 200);

    // 5. A good file after it.
    let t = Instant::now();
    configmap_swap(&root, "..2026_11_22_v4", &config(&up, "v6"));
    let recovered = visible_after(&gw, &client, "v6", t).await;
    let status = client.get(&gw.admin_url("/config")).await.json();
    assert!(status["last_reload_error"].is_null(), "{status}");
    let sha = status["sha256"].as_str().expect("sha256");
    assert_eq!(sha.len(), 64);
    assert!(status["source"]
        .as_str()
        .expect("source")
        .ends_with("policies.yaml"));

    stop.store(true, Ordering::Relaxed);
    for task in load {
        task.await.expect("load task");
    }
    let (ok, failed) = (ok.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
    eprintln!(
        "applied after: swap {swap:?}, rename {rename:?}, in place {in_place:?}, after a bad file {recovered:?}; {ok} requests ok, {failed} failed"
    );
    assert_eq!(
        failed,
        0,
        "failed requests during reloads (first: {:?}); log:\n{}",
        first_failure.lock().expect("lock"),
        gw.log()
    );
    assert!(ok > 100, "the load ran: {ok} requests");
    for (what, took) in [
        ("swap", swap),
        ("rename", rename),
        ("in place", in_place),
        ("recovery", recovered),
    ] {
        assert!(took <= APPLY_WITHIN, "{what} took {took:?}");
    }

    // The unchanged `carry` policy kept its counter through five reloads: 6 of 10 left.
    let statuses: Vec<u16> = {
        let mut v = Vec::new();
        for _ in 0..8 {
            v.push(client.get(&gw.url("/carry")).await.status);
        }
        v
    };
    assert_eq!(statuses, [200, 200, 200, 200, 200, 200, 429, 429]);

    let text = client.get(&gw.admin_url("/metrics")).await.text();
    let reloads = |result| {
        metric(
            &text,
            "turnstile_config_reloads_total",
            &[("result", result)],
        )
        .unwrap_or(0.0)
    };
    assert!(reloads("ok") >= 4.0, "ok reloads: {}", reloads("ok"));
    assert!(
        reloads("error") >= 1.0,
        "failed reloads: {}",
        reloads("error")
    );
    let log = gw.log();
    assert!(
        log.contains("route `marker` changed"),
        "the reload log names what changed:\n{log}"
    );
}

#[tokio::test]
async fn healthcheck_exits_0_when_ready_and_1_with_the_reason_when_not() {
    let gw = GatewayProcess::spawn("routes:\n  - name: hello\n    respond: {}\n").await;
    let probe = |url: String| {
        std::process::Command::new(BINARY)
            .args(["healthcheck", "--url", &url, "--timeout", "2s"])
            .output()
            .expect("run turnstile healthcheck")
    };
    let ready = probe(gw.admin_url("/readyz"));
    assert_eq!(ready.status.code(), Some(0), "{ready:?}");

    let missing = probe(gw.admin_url("/no-such-endpoint"));
    assert_eq!(missing.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&missing.stderr).contains("answered 404"),
        "{missing:?}"
    );

    drop(gw);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port");
    let down = probe(format!("http://{port}/readyz"));
    assert_eq!(down.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&down.stderr).contains("cannot reach"),
        "{down:?}"
    );
}

/// A config with one policy (1 an hour for each `x-tenant`) that names the overrides file `file`.
fn overrides_config(file: &str) -> String {
    support::process::with_free_ports(&format!(
        "overrides: {file}
routes:
  - name: api
    respond: {{body: ok}}
    policies:
      - name: tenant
        key: ['header:x-tenant']
        sliding_window: {{limit: 1, window: 1h}}
"
    ))
}

/// An overrides file that gives tenant `acme` `limit`.
fn acme_limit(limit: u32) -> String {
    format!("- {{route: api, policy: tenant, key: acme, limit: {limit}}}\n")
}

/// The statuses of `n` requests as tenant `acme`.
async fn as_acme(gw: &GatewayProcess, c: &Client, n: usize) -> Vec<u16> {
    let mut got = Vec::with_capacity(n);
    for _ in 0..n {
        got.push(
            c.get_with(&gw.url("/"), &[("x-tenant", "acme")])
                .await
                .status,
        );
    }
    got
}

/// Sends as `acme` until a request is admitted, and fails if `what` has not applied within
/// [`APPLY_WITHIN`]. Refusals consume nothing, so the count stays exact.
async fn first_admission(gw: &GatewayProcess, c: &Client, what: &str) {
    let since = Instant::now();
    while as_acme(gw, c, 1).await != [200] {
        assert!(
            since.elapsed() < APPLY_WITHIN,
            "{what} did not apply within {APPLY_WITHIN:?}:\n{}",
            gw.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The overrides file (issue 15) is watched as the config is: an edit in place applies within
/// [`APPLY_WITHIN`], without a signal, and the counter carries over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edit_of_the_overrides_file_applies_without_a_signal() {
    let (dir, path) = support::process::config_file(&overrides_config("overrides.yaml"));
    let overrides = dir.path().join("overrides.yaml");
    std::fs::write(&overrides, acme_limit(2)).expect("write overrides");
    let gw = GatewayProcess::spawn_at(dir, path, &[]).await;
    let c = Client::new();
    assert_eq!(as_acme(&gw, &c, 3).await, [200, 200, 429]);

    std::fs::write(&overrides, acme_limit(5)).expect("rewrite overrides");
    first_admission(&gw, &c, "the overrides edit").await;
    assert_eq!(
        as_acme(&gw, &c, 3).await,
        [200, 200, 429],
        "3 of 5 used, then 2 more"
    );
}

/// A reload that names another overrides file moves the watch to it: an edit of the new file
/// applies without a signal, as an edit of the first one did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_names_another_overrides_file_watches_that_file() {
    let yaml = overrides_config("first.yaml");
    let (dir, path) = support::process::config_file(&yaml);
    let second = dir.path().join("second.yaml");
    std::fs::write(dir.path().join("first.yaml"), acme_limit(2)).expect("write the first file");
    std::fs::write(&second, acme_limit(5)).expect("write the second file");
    let gw = GatewayProcess::spawn_at(dir, path.clone(), &[]).await;
    let c = Client::new();
    assert_eq!(
        as_acme(&gw, &c, 3).await,
        [200, 200, 429],
        "the first file's limit of 2"
    );

    save_by_rename(&path, &yaml.replace("first.yaml", "second.yaml"));
    first_admission(&gw, &c, "the config naming the second file").await;
    assert_eq!(
        as_acme(&gw, &c, 3).await,
        [200, 200, 429],
        "3 of the second file's 5 used, then 2 more"
    );

    // Only the second file changes: the watch on the first would see nothing.
    std::fs::write(&second, acme_limit(8)).expect("rewrite the second file");
    first_admission(&gw, &c, "the edit of the second file").await;
    assert_eq!(
        as_acme(&gw, &c, 3).await,
        [200, 200, 429],
        "6 of 8 used, then 2 more"
    );
}
