//! `turnstile import ingress-nginx` (issue 17): the corpus of manifests under `tests/import/`, each
//! with its golden policies file (`NAME.out.yaml`) and report (`NAME.report.txt`), compared
//! exactly; every golden passes the real binary's `check` and the library's loader; and the
//! generated configs, run against an in-test upstream, enforce what the annotations meant: beside
//! a real nginx with the `limit_req` ingress-nginx writes, and on two replicas sharing a real Redis.
//!
//! A manifest's `NAME.args`, when present, holds more command-line arguments for it.
//!
//! After a deliberate change of the output, regenerate the goldens with
//! `UPDATE_GOLDEN=1 cargo test --test import_ingress_nginx every_corpus` and review the diff.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use support::nginx::Nginx;
use support::process::{check, BINARY};
use support::{metric, Client, TestGateway, Upstream};

const CORPUS: &str = "tests/import";

/// The corpus manifests, sorted (goldens end in `.out.yaml`).
fn corpus() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(CORPUS);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("read the corpus directory")
        .map(|e| e.expect("corpus entry").path())
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            name.ends_with(".yaml") && !name.ends_with(".out.yaml")
        })
        .collect();
    files.sort();
    files
}

/// Runs the real binary: `turnstile import ingress-nginx ARGS...` in the crate directory, so the
/// file names it writes into the output header are the corpus's relative paths.
fn import(args: &[&str]) -> (Option<i32>, String, String) {
    let output = Command::new(BINARY)
        .args(["import", "ingress-nginx"])
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run turnstile import");
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn relative(path: &Path) -> String {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .expect("file name");
    format!("{CORPUS}/{name}")
}

fn golden(path: &Path, ext: &str) -> PathBuf {
    let stem = path.file_stem().and_then(|n| n.to_str()).expect("stem");
    path.with_file_name(format!("{stem}.{ext}"))
}

#[test]
fn every_corpus_manifest_imports_to_its_golden_policies_and_report() {
    let files = corpus();
    assert!(
        files.len() >= 12,
        "the corpus has {} manifests",
        files.len()
    );
    let update = std::env::var_os("UPDATE_GOLDEN").is_some();
    let mut mismatches = Vec::new();
    for file in &files {
        // `NAME.args`, when present: more arguments for that manifest (`--ingress-class nginx`).
        let extra = std::fs::read_to_string(golden(file, "args")).unwrap_or_default();
        let mut args = vec![relative(file)];
        args.extend(extra.split_whitespace().map(str::to_string));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, yaml, report) = import(&args);
        assert_eq!(code, Some(0), "{}: {report}", file.display());
        for (ext, actual) in [("out.yaml", &yaml), ("report.txt", &report)] {
            let path = golden(file, ext);
            if update {
                std::fs::write(&path, actual).expect("write golden");
                continue;
            }
            let expected = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("{}: {e} (UPDATE_GOLDEN=1 writes it)", path.display()));
            if &expected != actual {
                mismatches.push(format!(
                    "{}: differs from the output\n--- expected\n{expected}\n--- actual\n{actual}",
                    path.display()
                ));
            }
        }
    }
    assert!(mismatches.is_empty(), "{}", mismatches.join("\n"));
}

#[test]
fn every_golden_passes_check_and_loads() {
    for file in corpus() {
        let out = golden(&file, "out.yaml");
        let (code, stdout, stderr) = check(&out);
        assert_eq!(code, Some(0), "{}: {stderr}", out.display());
        assert!(stdout.contains(": ok ("), "{stdout}");
        let snapshot = turnstile::config::load(&out).unwrap_or_else(|e| panic!("{e}"));
        let routes = std::fs::read_to_string(&out)
            .expect("read golden")
            .matches("\n  - name: ")
            .count();
        assert_eq!(snapshot.routes.len(), routes, "{}", out.display());
    }
}

#[test]
fn the_report_names_the_ingress_and_the_annotation_of_what_is_not_mapped() {
    let (_, _, report) = import(&[&format!("{CORPUS}/07-annotations-not-mapped.yaml")]);
    for annotation in [
        "force-ssl-redirect",
        "auth-type",
        "enable-cors",
        "whitelist-source-range",
        "configuration-snippet",
    ] {
        let line = format!("backoffice/legacy-admin: nginx.ingress.kubernetes.io/{annotation}=");
        assert!(report.contains(&line), "no {line} in:\n{report}");
    }
    // Mapped: limit-connections (a concurrency policy), rewrite-target and the use-regex it implies
    // (the route's rewrite).
    for annotation in ["limit-connections", "rewrite-target", "use-regex"] {
        let line = format!("backoffice/legacy-admin: nginx.ingress.kubernetes.io/{annotation}=");
        assert!(!report.contains(&line), "{line} in:\n{report}");
    }
    // Values that ask for what Turnstile does anyway are not reported.
    assert!(!report.contains("ssl-redirect=\"false\""), "{report}");
    assert!(!report.contains("backend-protocol=\"HTTP\""), "{report}");
}

/// `--ingress-class`: another controller's Ingresses and those with no class are skipped and
/// named in the report; `--watch-ingress-without-class` takes the latter too; a class no Ingress
/// has is an error that says what was skipped, and nothing is written.
#[test]
fn ingress_class_takes_only_that_class_and_reports_the_skipped() {
    let input = format!("{CORPUS}/16-ingress-class.yaml");
    let (code, yaml, report) = import(&[&input, "--ingress-class", "nginx"]);
    assert_eq!(code, Some(0), "{report}");
    assert!(
        report.starts_with("turnstile import: 2 Ingresses -> 2 routes, 2 upstreams;"),
        "{report}"
    );
    for skipped in [
        "kube-system/dashboard: class traefik (spec.ingressClassName), not nginx: skipped",
        "ops/internal: class nginx-internal (kubernetes.io/ingress.class), not nginx: skipped",
        "ops/moved: class haproxy (spec.ingressClassName), not nginx: skipped",
        "default/orphan: no class (neither spec.ingressClassName nor the kubernetes.io/ingress.class annotation): skipped",
    ] {
        assert!(report.contains(skipped), "no {skipped} in:\n{report}");
    }
    for host in [
        "traefik.example.com",
        "ops.example.com",
        "moved.example.com",
        "orphan.example.com",
    ] {
        assert!(!yaml.contains(host), "{host} imported:\n{yaml}");
    }
    let (code, yaml, report) = import(&[
        &input,
        "--ingress-class",
        "nginx",
        "--watch-ingress-without-class",
    ]);
    assert_eq!(code, Some(0), "{report}");
    assert!(yaml.contains("host: orphan.example.com"), "{yaml}");
    assert!(!report.contains("default/orphan"), "{report}");

    let (code, stdout, stderr) = import(&[&input, "--ingress-class", "contour"]);
    assert_eq!(code, Some(1), "{stderr}");
    assert_eq!(stdout, "");
    assert!(
        stderr.contains("no networking.k8s.io/v1 Ingress of class `contour` in the input")
            && stderr
                .contains("web/shop: class nginx (spec.ingressClassName), not contour: skipped"),
        "{stderr}"
    );
    // Without the filter every Ingress is imported, whatever its class.
    let (code, _, report) = import(&[&input]);
    assert_eq!(code, Some(0), "{report}");
    assert!(
        report.starts_with("turnstile import: 6 Ingresses"),
        "{report}"
    );
}

#[test]
fn several_files_import_together_and_o_writes_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("policies.yaml");
    let (code, stdout, report) = import(&[
        &format!("{CORPUS}/01-storefront-rps.yaml"),
        &format!("{CORPUS}/02-api-hosts-and-paths.yaml"),
        "-o",
        out.to_str().expect("utf-8 path"),
    ]);
    assert_eq!(code, Some(0), "{report}");
    assert_eq!(stdout, "", "the config goes to the file only");
    assert!(
        report.starts_with("turnstile import: 2 Ingresses -> 6 routes, 4 upstreams;"),
        "{report}"
    );
    let (code, stdout, stderr) = check(&out);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.ends_with(": ok (6 routes)\n"), "{stdout}");
}

#[test]
fn bad_input_is_a_clear_error_naming_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cases = [
        ("broken.yaml", "apiVersion: v1\nkind: [unclosed\n", "broken.yaml: document 1: not YAML"),
        (
            "bad-ingress.yaml",
            "---\napiVersion: networking.k8s.io/v1\nkind: Ingress\nmetadata: { name: x }\nspec: { rules: 3 }\n",
            "bad-ingress.yaml: document 1: not a valid networking.k8s.io/v1 Ingress",
        ),
        (
            "only-services.yaml",
            "apiVersion: v1\nkind: Service\nmetadata: { name: s }\n",
            "no networking.k8s.io/v1 Ingress in the input",
        ),
        ("plain.yaml", "just: text\n", "plain.yaml: document 1: not a Kubernetes object"),
    ];
    for (name, text, expected) in cases {
        let path = dir.path().join(name);
        std::fs::write(&path, text).expect("write input");
        let (code, stdout, stderr) = import(&[path.to_str().expect("utf-8 path")]);
        assert_eq!(code, Some(1), "{name}: {stderr}");
        assert_eq!(stdout, "", "{name}: nothing written");
        assert!(stderr.contains(expected), "{name}: {stderr}");
    }
    let (code, _, stderr) = import(&["tests/import/no-such-file.yaml"]);
    assert_eq!(code, Some(1));
    assert!(
        stderr.contains("cannot read tests/import/no-such-file.yaml"),
        "{stderr}"
    );
}

/// The import of a corpus manifest (by the library, so these tests follow the code, while the
/// golden test pins the text), with every upstream pointed at `$UPSTREAM` and behind a trusted
/// proxy on loopback, so a test can pick the client IP with `X-Forwarded-For`.
fn runnable(name: &str) -> String {
    runnable_with(name, |_| "http://$UPSTREAM".to_string())
}

/// [`runnable`] with each upstream's url replaced by `url(imported url)`.
fn runnable_with(name: &str, url: impl Fn(&str) -> String) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(CORPUS)
        .join(format!("{name}.yaml"));
    let manifest = std::fs::read_to_string(&path).expect("read corpus manifest");
    let yaml = turnstile::import::ingress_nginx(&[(name.to_string(), manifest)])
        .unwrap_or_else(|e| panic!("{name}: {e}"))
        .yaml;
    let mut out = String::from("client_ip:\n  trusted_proxies: [127.0.0.1]\n");
    for line in yaml.lines() {
        match line.split_once("url: ") {
            Some((indent, imported)) => {
                out.push_str(&format!("{indent}url: \"{}\"", url(imported)))
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// Sends GETs one after another until one is not 200; asserts that `expected` were admitted (more
/// only by what `rate` per second refilled meanwhile, measured) and that the first refusal is a
/// 429. Returns the count and the refusal.
async fn back_to_back(
    c: &Client,
    url: &str,
    headers: &[(&str, &str)],
    expected: u64,
    rate: f64,
) -> (u64, support::Reply) {
    let started = Instant::now();
    let mut admitted = 0u64;
    let rejected = loop {
        let reply = c.get_with(url, headers).await;
        if reply.status != 200 {
            break reply;
        }
        admitted += 1;
        assert!(admitted < 10 * expected, "never limited");
    };
    let refill = (started.elapsed().as_secs_f64() * rate).floor() as u64;
    assert!(
        (expected..=expected + refill).contains(&admitted),
        "{admitted} admitted back to back; {expected} expected (+{refill} refilled)"
    );
    assert_eq!(rejected.status, 429, "{}", rejected.text());
    (admitted, rejected)
}

/// What ingress-nginx writes for the same annotations (`limit-rps: "5"`,
/// `limit-burst-multiplier: "3"`, with `limit-req-status-code` 429): nginx admits burst + 1 back to
/// back where the imported token bucket admits the burst (docs/migration.md).
#[tokio::test]
async fn nginx_limit_req_admits_one_more_than_the_imported_bucket_at_once() {
    // limit_req runs in the preaccess phase, before try_files hands over to `@ok` (a `return` in
    // the location itself would answer in the rewrite phase, before any limit).
    let nginx = Nginx::start_with(
        "location / { limit_req zone=rps burst=15 nodelay; try_files /none @ok; }\n\
         location @ok { return 200 \"ok\\n\"; }",
        "limit_req_zone $binary_remote_addr zone=rps:1m rate=5r/s;\nlimit_req_status 429;",
    );
    let url = format!("{}/", nginx.base_url());
    let (admitted, _) = back_to_back(&Client::new(), &url, &[], 16, 5.0).await;
    eprintln!("nginx, rate=5r/s burst=15 nodelay: {admitted} admitted back to back, then 429");
}

async fn get(c: &Client, gw: &TestGateway, host: &str, path: &str, client: &str) -> u16 {
    let headers = [("host", host), ("x-forwarded-for", client)];
    c.get_with(&gw.url(path), &headers).await.status
}

#[tokio::test]
async fn limit_rps_5_with_multiplier_3_admits_exactly_15_at_once_and_never_limits_the_whitelist() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(&runnable("01-storefront-rps"), upstream.addr).await;
    let c = Client::new();
    let host = "shop.example.com";
    // The rate (5/s) refills a token every 200 ms: count how many pass in a tight loop and
    // allow for refill during it, measured.
    let headers = [("host", host), ("x-forwarded-for", "198.51.100.20")];
    let (admitted, rejected) = back_to_back(&c, &gw.url("/cart"), &headers, 15, 5.0).await;
    assert_eq!(
        rejected.json()["policy"],
        "shop_storefront_rps",
        "{}",
        rejected.text()
    );
    eprintln!("turnstile, limit-rps 5 x 3: {admitted} admitted back to back, then 429");

    // limit-whitelist: 10.0.0.0/8 and 192.168.12.7 are exempt, however much they send.
    for client in ["10.1.2.3", "192.168.12.7"] {
        for _ in 0..40 {
            assert_eq!(get(&c, &gw, host, "/", client).await, 200, "{client}");
        }
    }
    // Another client has its own bucket; another host is no route at all.
    assert_eq!(get(&c, &gw, host, "/", "198.51.100.21").await, 200);
    assert_eq!(
        get(&c, &gw, "other.example.com", "/", "198.51.100.21").await,
        404
    );

    let text = gw.metrics().await;
    assert_eq!(
        metric(
            &text,
            "turnstile_exempt_total",
            &[("route", "shop_storefront_0")]
        ),
        Some(80.0)
    );
}

#[tokio::test]
async fn global_rate_limit_is_a_sliding_window_per_api_key_and_ignored_cidrs_are_exempt() {
    let upstream = Upstream::start().await;
    let gw =
        TestGateway::with_upstream(&runnable("05-global-rate-limit-api-key"), upstream.addr).await;
    let c = Client::new();
    let send = |key: &'static str, client: &'static str| {
        let c = c.clone();
        let url = gw.url("/api/orders");
        async move {
            let headers = [
                ("host", "partners.example.com"),
                ("x-api-key", key),
                ("x-forwarded-for", client),
            ];
            c.get_with(&url, &headers).await.status
        }
    };
    // 100 per minute per key, whichever client IP sends it.
    for i in 0..100 {
        let client = if i % 2 == 0 {
            "203.0.113.1"
        } else {
            "203.0.113.2"
        };
        assert_eq!(send("key-a", client).await, 200, "request {i}");
    }
    assert_eq!(send("key-a", "203.0.113.3").await, 429);
    assert_eq!(
        send("key-b", "203.0.113.1").await,
        200,
        "another key counts apart"
    );
    // global-rate-limit-ignored-cidrs: 198.51.100.0/24.
    for _ in 0..5 {
        assert_eq!(send("key-a", "198.51.100.9").await, 200);
    }
    // Element-wise Prefix: /api matches /api and /api/..., never /apis.
    let status = |path: &'static str| {
        let c = c.clone();
        let url = gw.url(path);
        async move {
            c.get_with(
                &url,
                &[("host", "partners.example.com"), ("x-api-key", "key-c")],
            )
            .await
            .status
        }
    };
    assert_eq!(status("/api").await, 200);
    assert_eq!(status("/apis").await, 404);
}

#[tokio::test]
async fn a_host_serves_404_for_its_unknown_paths_instead_of_the_rules_without_a_host() {
    let upstream = Upstream::start().await;
    let gw =
        TestGateway::with_upstream(&runnable("11-canary-default-backend"), upstream.addr).await;
    let c = Client::new();
    let client = "198.51.100.30";
    assert_eq!(get(&c, &gw, "www.example.com", "/app/x", client).await, 200);
    assert_eq!(
        get(&c, &gw, "www.example.com", "/elsewhere", client).await,
        404
    );
    assert_eq!(
        get(&c, &gw, "unknown.example.com", "/elsewhere", client).await,
        200,
        "defaultBackend"
    );
    assert_eq!(upstream.requests(), 2);
}

/// Which route served each request, read from `turnstile_requests_total{route}`: the imported
/// order must give nginx's precedence (Exact first, then the longest prefix, element-wise).
#[tokio::test]
async fn imported_routes_follow_nginx_precedence_and_element_wise_prefixes() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(&runnable("02-api-hosts-and-paths"), upstream.addr).await;
    let c = Client::new();
    let cases = [
        ("api.example.com", "/healthz", Some("api_public-api_3")),
        ("api.example.com", "/v2/orders/7", Some("api_public-api_1")),
        ("api.example.com", "/v2/orders", Some("api_public-api_1")),
        (
            "api.example.com",
            "/v2/orderstatus",
            Some("api_public-api_2"),
        ),
        ("api.example.com", "/v2", Some("api_public-api_2")),
        (
            "api.example.com",
            "/v1/users?page=2",
            Some("api_public-api_0"),
        ),
        ("api.example.com", "/v10", None),
        ("api.example.com", "/healthz/deep", None),
        ("api.example.org", "/anything", Some("api_public-api_4")),
    ];
    for (i, (host, path, route)) in cases.iter().enumerate() {
        let status = get(&c, &gw, host, path, "198.51.100.40").await;
        let text = gw.metrics().await;
        let served = |r: &str| {
            metric(
                &text,
                "turnstile_requests_total",
                &[("route", r), ("code", "2xx")],
            )
            .unwrap_or(0.0)
        };
        match route {
            Some(route) => {
                assert_eq!(status, 200, "{host}{path}");
                let before = cases[..i].iter().filter(|c| c.2 == Some(*route)).count();
                assert_eq!(
                    served(route),
                    (before + 1) as f64,
                    "{host}{path} -> {route}"
                );
            }
            None => assert_eq!(status, 404, "{host}{path}: no route"),
        }
    }
}

#[test]
fn stdin_is_read_for_a_dash() {
    use std::io::Write as _;
    let manifest = std::fs::read(format!(
        "{}/{CORPUS}/01-storefront-rps.yaml",
        env!("CARGO_MANIFEST_DIR")
    ))
    .expect("read corpus");
    let mut child = Command::new(BINARY)
        .args(["import", "ingress-nginx", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn import");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(&manifest)
        .expect("write stdin");
    let output = child.wait_with_output().expect("import output");
    assert!(output.status.success(), "{output:?}");
    let yaml = String::from_utf8_lossy(&output.stdout);
    assert!(
        yaml.starts_with("# Generated by `turnstile import ingress-nginx` from -."),
        "{yaml}"
    );
    assert!(
        yaml.contains("token_bucket: { rate: 5/s, burst: 15 }"),
        "{yaml}"
    );
}

/// The point of migrating: ingress-nginx's zone lives in each controller pod, so two replicas
/// admit up to twice the burst; the imported config on a shared Redis store admits it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_on_redis_admit_the_imported_burst_once_not_once_per_replica() {
    let redis = support::RedisServer::start();
    let upstream = Upstream::start().await;
    let store = format!(
        "store:\n  type: redis\n  url: {}\n  timeout: 2s\n  failure_mode: closed\n",
        redis.url()
    );
    let yaml = format!("{store}{}", runnable("01-storefront-rps"))
        .replace("$UPSTREAM", &upstream.addr.to_string());
    let replicas = [
        support::GatewayProcess::spawn(&yaml).await,
        support::GatewayProcess::spawn(&yaml).await,
    ];
    let c = Client::new();
    // Each replica has reached Redis once (a client of its own, so the test's budget is whole).
    for gw in &replicas {
        let deadline = Instant::now() + support::LIVENESS;
        let probe = [
            ("host", "shop.example.com"),
            ("x-forwarded-for", "198.51.100.99"),
        ];
        while c.get_with(&gw.url("/"), &probe).await.status != 200 {
            assert!(
                Instant::now() < deadline,
                "no decision from Redis: {}",
                gw.log()
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }
    let headers = [
        ("host", "shop.example.com"),
        ("x-forwarded-for", "198.51.100.50"),
    ];
    let started = Instant::now();
    let mut admitted = 0u64;
    for i in 0..40 {
        let reply = c.get_with(&replicas[i % 2].url("/"), &headers).await;
        match reply.status {
            200 => admitted += 1,
            429 => {}
            other => panic!("request {i}: {other} {}", reply.text()),
        }
    }
    let refill = (started.elapsed().as_secs_f64() * 5.0).floor() as u64;
    assert!(
        (15..=15 + refill).contains(&admitted),
        "{admitted} admitted by two replicas; 15 expected (+{refill} refilled)"
    );
    eprintln!("two replicas on Redis, limit-rps 5 x 3: {admitted} of 40 admitted");
}

/// Each pathType as imported: Exact is exact, Prefix element-wise (a trailing `/` ignored),
/// ImplementationSpecific a string prefix, an Exact path with `{}` matched percent-encoded.
#[tokio::test]
async fn imported_path_types_match_what_kubernetes_and_nginx_match() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(&runnable("09-path-types"), upstream.addr).await;
    let c = Client::new();
    let host = "docs.example.com";
    let cases = [
        ("/", 200),
        ("/index.html", 404),
        ("/guides", 200),
        ("/guides/", 200),
        ("/guides/intro", 200),
        ("/guidesx", 404),
        ("/reference/%7Bversion%7D", 200),
        ("/reference/v2", 404),
        ("/static", 200),
        ("/static-assets/app.js", 200),
        ("/old-blog/2019", 200),
        ("/search", 404),
    ];
    for (path, want) in cases {
        assert_eq!(
            get(&c, &gw, host, path, "198.51.100.60").await,
            want,
            "{path}"
        );
    }
}

/// The path the in-test upstream received (its JSON echo's `path`, with the query).
fn echoed_path(reply: &support::Reply) -> String {
    reply.json()["path"]
        .as_str()
        .unwrap_or_else(|| panic!("no echo: {}", reply.text()))
        .to_string()
}

/// `rewrite-target` with a capture group, and with a fixed target: what ingress-nginx writes for
/// the two Ingresses of `15-rewrite-target` (a `location ~*` and a `rewrite ... break`, proxied to
/// the same upstream) and the imported routes forward the same path for every request, and
/// neither serves a path outside the pattern.
#[tokio::test]
async fn imported_rewrites_forward_the_paths_nginx_rewrite_target_forwards() {
    let upstream = Upstream::start().await;
    let nginx = Nginx::start(&format!(
        "location ~* \"^/something(/|$)(.*)\" {{ rewrite \"(?i)/something(/|$)(.*)\" /$2 break; proxy_pass http://{up}; }}\n\
         location ~* \"^/welcome\" {{ rewrite \"(?i)/welcome\" /index.html break; proxy_pass http://{up}; }}\n\
         location / {{ return 404; }}",
        up = upstream.addr
    ));
    let gw = TestGateway::with_upstream(&runnable("15-rewrite-target"), upstream.addr).await;
    let c = Client::new();
    let cases = [
        ("rewrite.bar.com", "/something", Some("/")),
        ("rewrite.bar.com", "/something/", Some("/")),
        ("rewrite.bar.com", "/something/new", Some("/new")),
        (
            "rewrite.bar.com",
            "/something/a/b?page=2",
            Some("/a/b?page=2"),
        ),
        ("rewrite.bar.com", "/somethingelse", None),
        ("www.bar.com", "/welcome", Some("/index.html")),
        (
            "www.bar.com",
            "/welcome/tour?lang=fr",
            Some("/index.html?lang=fr"),
        ),
        ("www.bar.com", "/welcomes", Some("/index.html")),
    ];
    for (host, path, want) in cases {
        let headers = [("host", host)];
        let from_nginx = c
            .get_with(&format!("{}{path}", nginx.base_url()), &headers)
            .await;
        let from_turnstile = c.get_with(&gw.url(path), &headers).await;
        match want {
            Some(want) => {
                assert_eq!(from_nginx.status, 200, "nginx {host}{path}");
                assert_eq!(echoed_path(&from_nginx), want, "nginx {host}{path}");
                assert_eq!(from_turnstile.status, 200, "turnstile {host}{path}");
                assert_eq!(echoed_path(&from_turnstile), want, "turnstile {host}{path}");
            }
            None => {
                assert_eq!(from_nginx.status, 404, "nginx {host}{path}");
                assert_eq!(from_turnstile.status, 404, "turnstile {host}{path}");
            }
        }
    }
}

/// `limit-connections: "3"`: beside nginx's `limit_conn` as ingress-nginx writes it (per client
/// address, status set to 429 here to compare), three requests held at the upstream leave a fourth
/// from the same client refused, another client served, the whitelist never limited; once they
/// end, the client is served again.
#[tokio::test]
async fn limit_connections_3_refuses_the_fourth_request_in_flight_as_nginx_limit_conn_does() {
    let upstream = Upstream::start().await;
    let nginx = Nginx::start_with(
        &format!(
            "location / {{ limit_conn conn 3; proxy_pass http://{}; }}",
            upstream.addr
        ),
        "limit_conn_zone $binary_remote_addr zone=conn:1m;\nlimit_conn_status 429;",
    );
    let gw = TestGateway::with_upstream(&runnable("13-limit-connections"), upstream.addr).await;
    let c = Client::new();
    let client = "198.51.100.70";
    let held = [
        ("host", "files.example.com"),
        ("x-forwarded-for", client),
        ("x-test-hold-head", "1"),
    ];
    for (door, base) in [("nginx", nginx.base_url()), ("turnstile", gw.url(""))] {
        let before = upstream.requests();
        let mut tasks = Vec::new();
        for _ in 0..3 {
            let (c, url) = (c.clone(), format!("{base}/releases/big.iso"));
            tasks.push(tokio::spawn(
                async move { c.get_with(&url, &held).await.status },
            ));
        }
        upstream.wait_for_requests(before + 3).await;
        let fourth = c
            .get_with(
                &format!("{base}/releases/other.iso"),
                &[("host", "files.example.com"), ("x-forwarded-for", client)],
            )
            .await;
        assert_eq!(fourth.status, 429, "{door}: {}", fourth.text());
        upstream.release(3);
        for task in tasks {
            assert_eq!(task.await.expect("task"), 200, "{door}");
        }
        let again = c
            .get_with(
                &format!("{base}/releases/big.iso"),
                &[("host", "files.example.com"), ("x-forwarded-for", client)],
            )
            .await;
        assert_eq!(again.status, 200, "{door}: served once the three ended");
    }

    // Turnstile only (nginx here sees one address): another client is served, and the whitelist
    // 10.8.0.0/16 is exempt however many it has in flight.
    for (who, n) in [("198.51.100.71", 3), ("10.8.4.2", 6)] {
        let before = upstream.requests();
        let headers = [
            ("host", "files.example.com"),
            ("x-forwarded-for", who),
            ("x-test-hold-head", "1"),
        ];
        let mut tasks = Vec::new();
        for _ in 0..n {
            let (c, url) = (c.clone(), gw.url("/nightly/x"));
            tasks.push(tokio::spawn(async move {
                c.get_with(&url, &headers).await.status
            }));
        }
        upstream.wait_for_requests(before + n).await;
        upstream.release(n);
        for task in tasks {
            assert_eq!(task.await.expect("task"), 200, "{who}");
        }
    }
}

/// One `limit_conn` zone per Ingress in ingress-nginx: the two paths of `files/downloads` share a
/// client's 3 requests in flight, in nginx (two locations, one zone) and in the imported config
/// (one shared policy), so 2 held on one path and 1 on the other leave none for either.
#[tokio::test]
async fn the_paths_of_one_ingress_share_its_limit_as_nginx_does() {
    let upstream = Upstream::start().await;
    let nginx = Nginx::start_with(
        &format!(
            "location /releases {{ limit_conn conn 3; proxy_pass http://{0}; }}\n\
             location /nightly {{ limit_conn conn 3; proxy_pass http://{0}; }}",
            upstream.addr
        ),
        "limit_conn_zone $binary_remote_addr zone=conn:1m;\nlimit_conn_status 429;",
    );
    let gw = TestGateway::with_upstream(&runnable("13-limit-connections"), upstream.addr).await;
    let c = Client::new();
    let client = [
        ("host", "files.example.com"),
        ("x-forwarded-for", "198.51.100.80"),
    ];
    let held = [client[0], client[1], ("x-test-hold-head", "1")];
    for (door, base) in [("nginx", nginx.base_url()), ("turnstile", gw.url(""))] {
        let before = upstream.requests();
        let mut tasks = Vec::new();
        for path in ["/releases/a.iso", "/releases/b.iso", "/nightly/c.iso"] {
            let (c, url) = (c.clone(), format!("{base}{path}"));
            tasks.push(tokio::spawn(
                async move { c.get_with(&url, &held).await.status },
            ));
        }
        upstream.wait_for_requests(before + 3).await;
        for path in ["/nightly/d.iso", "/releases/e.iso"] {
            let fourth = c.get_with(&format!("{base}{path}"), &client).await;
            assert_eq!(fourth.status, 429, "{door} {path}: {}", fourth.text());
        }
        upstream.release(3);
        for task in tasks {
            assert_eq!(task.await.expect("task"), 200, "{door}");
        }
        let again = c.get_with(&format!("{base}/nightly/d.iso"), &client).await;
        assert_eq!(again.status, 200, "{door}: served once the three ended");
    }
    assert_eq!(
        gw.metric(
            "turnstile_decisions_total",
            &[
                ("route", "files_downloads_1"),
                ("policy", "files_downloads_connections"),
                ("decision", "limited"),
            ],
        )
        .await,
        1.0
    );
}

/// `backend-protocol: HTTPS` against a real nginx serving TLS with a certificate the gateway has
/// no CA for (as a cluster-internal service's usually is): the imported upstream, like
/// ingress-nginx without `proxy-ssl-verify`, reaches it; the one imported with
/// `proxy-ssl-verify: "on"` verifies and refuses it (502).
#[tokio::test]
async fn backend_protocol_https_reaches_an_unverified_upstream_and_proxy_ssl_verify_verifies() {
    use support::tls::{Pki, Usage};
    let pki = Pki::new("Cluster-internal CA");
    let (cert, key) = pki.leaf("dashboard", 3, Usage::Server);
    let nginx = Nginx::start_ssl(&format!(
        "ssl_certificate {};\nssl_certificate_key {};\nlocation / {{ return 200 \"tls ok $request_uri\\n\"; }}",
        cert.display(),
        key.display()
    ));
    let upstream = Upstream::start().await;
    let tls = format!("https://localhost:{}", nginx.addr.port());
    let yaml = runnable_with("14-backend-https", |imported| {
        if imported.starts_with("https://") {
            tls.clone()
        } else {
            "http://$UPSTREAM".to_string()
        }
    });
    let gw = TestGateway::with_upstream(&yaml, upstream.addr).await;
    let c = Client::new();
    let reply = c
        .get_with(&gw.url("/d/1"), &[("host", "dash.example.com")])
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.text(), "tls ok /d/1\n");
    let plain = c
        .get_with(&gw.url("/metrics"), &[("host", "dash.example.com")])
        .await;
    assert_eq!(
        plain.status, 200,
        "the plain-HTTP Ingress of the same Service"
    );
    assert_eq!(echoed_path(&plain), "/metrics");
    let verified = c
        .get_with(&gw.url("/"), &[("host", "vault.example.com")])
        .await;
    assert_eq!(verified.status, 502, "{}", verified.text());
}

/// docs/migration.md shows the importer's output: every `yaml` block there is a verbatim excerpt of
/// a corpus golden (which `every_golden_passes_check_and_loads` loads), so the page cannot drift
/// from what the importer writes.
#[test]
fn the_yaml_shown_in_the_migration_guide_is_what_the_importer_writes() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let guide = std::fs::read_to_string(root.join("docs/migration.md")).expect("read the guide");
    let goldens: Vec<String> = corpus()
        .iter()
        .map(|f| std::fs::read_to_string(golden(f, "out.yaml")).expect("read golden"))
        .collect();
    let mut blocks = 0;
    for block in guide.split("```yaml\n").skip(1) {
        let snippet = block.split("```").next().expect("a closed block");
        blocks += 1;
        assert!(
            goldens.iter().any(|g| g.contains(snippet)),
            "not in any tests/import/*.out.yaml:\n{snippet}"
        );
    }
    assert!(blocks >= 3, "{blocks} yaml blocks in docs/migration.md");
}
