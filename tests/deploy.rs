//! The docker-compose deployment, checked without a Docker engine: the compose file validates, its
//! Turnstile config loads and listens where Prometheus scrapes it, its Prometheus config is valid,
//! and nothing but the public listener is published beyond the host's loopback.

mod support;

use serde_json::Value;

use support::tools::{repo_path, run_ok};

const INSTALL_COMPOSE: &str = "Debian: apt-get install docker-compose";
const INSTALL_PROMETHEUS: &str = "Debian: apt-get install prometheus";

/// The compose file as docker-compose resolves it (variables at their defaults).
fn resolved_compose() -> Value {
    let text = run_ok(
        "docker-compose",
        &["-f", "docker-compose.yml", "config"],
        INSTALL_COMPOSE,
    );
    serde_norway::from_str(&text).expect("docker-compose config prints YAML")
}

#[test]
fn compose_file_validates() {
    run_ok(
        "docker-compose",
        &["-f", "docker-compose.yml", "config", "-q"],
        INSTALL_COMPOSE,
    );
}

#[test]
fn compose_publishes_only_the_public_listener_beyond_loopback() {
    let compose = resolved_compose();
    let services = compose["services"].as_object().expect("services");
    for name in ["redis", "api", "turnstile", "prometheus", "grafana"] {
        assert!(services.contains_key(name), "service {name} is missing");
    }
    for (name, service) in services {
        for port in service["ports"].as_array().into_iter().flatten() {
            // docker-compose prints either [HOST_IP:]HOST_PORT:CONTAINER_PORT/PROTO or, without a
            // host IP, {published, target}: then it listens on every interface.
            let (loopback, target) = match port.as_str() {
                Some(short) => (
                    short.starts_with("127.0.0.1:"),
                    short
                        .rsplit(':')
                        .next()
                        .unwrap_or("")
                        .trim_end_matches("/tcp")
                        .to_string(),
                ),
                None => (port["host_ip"] == "127.0.0.1", port["target"].to_string()),
            };
            let public = name == "turnstile" && target == "8080";
            assert!(
                public || loopback,
                "{name} publishes {port} beyond the host's loopback"
            );
        }
    }
    for internal in ["redis", "api"] {
        assert!(
            services[internal]["ports"].is_null(),
            "{internal} must stay inside the compose network"
        );
    }
}

#[test]
fn compose_turnstile_config_loads_and_listens_where_prometheus_scrapes() {
    let compose = resolved_compose();
    let turnstile = &compose["services"]["turnstile"];
    let volumes: Vec<&str> = turnstile["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(
        volumes
            .iter()
            .any(|v| v.ends_with("deploy/compose/policies.yaml:/etc/turnstile/policies.yaml:ro")),
        "the compose config is mounted where the image's CMD reads it: {volumes:?}"
    );

    let snapshot = turnstile::config::load(&repo_path("deploy/compose/policies.yaml"))
        .unwrap_or_else(|e| panic!("deploy/compose/policies.yaml:\n{e}"));
    assert!(
        matches!(
            snapshot.store,
            turnstile::config::StoreSettings::Redis { .. }
        ),
        "the compose deployment uses the Redis store"
    );
    assert_eq!(
        snapshot.listen.map(|a| a.to_string()).as_deref(),
        Some("0.0.0.0:8080")
    );
    // 0.0.0.0 so that Prometheus reaches it over the compose network.
    assert_eq!(snapshot.admin_listen.to_string(), "0.0.0.0:9901");

    let prometheus =
        std::fs::read_to_string(repo_path("deploy/compose/prometheus.yml")).expect("read");
    let prometheus: Value = serde_norway::from_str(&prometheus).expect("YAML");
    let job = prometheus["scrape_configs"]
        .as_array()
        .expect("scrape_configs")
        .iter()
        .find(|j| j["job_name"] == "turnstile")
        .expect("a turnstile job");
    let sd = &job["dns_sd_configs"][0];
    assert_eq!(sd["names"][0], "turnstile", "scrapes the compose service");
    assert_eq!(sd["port"], 9901, "scrapes the admin listener");
}

#[test]
fn compose_prometheus_config_validates() {
    // The compose file mounts the rules at /etc/prometheus/alerts.yml; point at the repository's.
    let text = std::fs::read_to_string(repo_path("deploy/compose/prometheus.yml")).expect("read");
    assert!(
        text.contains("/etc/prometheus/alerts.yml"),
        "the compose Prometheus loads the alerts"
    );
    let alerts = repo_path("dashboards/alerts.yml");
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("prometheus.yml");
    std::fs::write(
        &path,
        text.replace("/etc/prometheus/alerts.yml", &alerts.display().to_string()),
    )
    .expect("write");
    run_ok(
        "promtool",
        &["check", "config", &path.display().to_string()],
        INSTALL_PROMETHEUS,
    );
}

#[test]
fn grafana_provisioning_points_at_the_dashboard() {
    let compose = resolved_compose();
    let grafana = &compose["services"]["grafana"];
    let volumes: Vec<&str> = grafana["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let provider = std::fs::read_to_string(repo_path(
        "dashboards/provisioning/dashboards/turnstile.yml",
    ))
    .expect("read provider");
    let provider: Value = serde_norway::from_str(&provider).expect("YAML");
    let dashboards_dir = provider["providers"][0]["options"]["path"]
        .as_str()
        .expect("a provider path");
    assert!(
        volumes.iter().any(|v| v.ends_with(&format!(
            "dashboards/turnstile.json:{dashboards_dir}/turnstile.json:ro"
        ))),
        "the dashboard is mounted where the provider looks: {volumes:?}"
    );

    let datasource = std::fs::read_to_string(repo_path(
        "dashboards/provisioning/datasources/prometheus.yml",
    ))
    .expect("read datasource");
    let datasource: Value = serde_norway::from_str(&datasource).expect("YAML");
    assert_eq!(datasource["datasources"][0]["type"], "prometheus");
    assert_eq!(
        datasource["datasources"][0]["url"],
        "http://prometheus:9090"
    );

    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(repo_path("dashboards/turnstile.json")).expect("read dashboard"),
    )
    .expect("JSON");
    // Every panel and query picks its data source through the dashboard's variable.
    for panel in dashboard["panels"].as_array().expect("panels") {
        assert_eq!(
            panel["datasource"]["uid"], "${datasource}",
            "{}",
            panel["title"]
        );
        for target in panel["targets"].as_array().expect("targets") {
            assert_eq!(
                target["datasource"]["uid"], "${datasource}",
                "{}",
                panel["title"]
            );
        }
    }
}

#[test]
fn compose_waits_for_turnstile_to_be_ready_by_its_own_healthcheck() {
    let compose = resolved_compose();
    let services = &compose["services"];
    let test: Vec<&str> = services["turnstile"]["healthcheck"]["test"]
        .as_array()
        .expect("a healthcheck on turnstile")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    // The image has no shell or curl: the check is the binary's own exec-form probe.
    assert_eq!(test[0], "CMD", "{test:?}");
    assert_eq!(&test[1..3], ["/usr/local/bin/turnstile", "healthcheck"]);
    assert_eq!(
        services["prometheus"]["depends_on"]["turnstile"]["condition"],
        "service_healthy"
    );
    // Grafana stays off host port 3000, which the README uses for the user's own API.
    for port in services["grafana"]["ports"].as_array().expect("ports") {
        // Short form `[HOST_IP:]HOST_PORT:CONTAINER_PORT[/PROTO]`, or long form {published, ..}.
        let published = match port.as_str() {
            Some(short) => {
                let parts: Vec<&str> = short.split(':').collect();
                parts[parts.len().saturating_sub(2)].to_string()
            }
            None => port["published"].to_string().trim_matches('"').to_string(),
        };
        assert!(published.parse::<u16>().is_ok(), "cannot read {port}");
        assert_ne!(published, "3000", "{port}");
    }
}

#[test]
fn the_image_default_config_has_the_lines_the_dockerfile_rewrites() {
    // The Dockerfile moves both listeners of the example onto the container's interfaces; the
    // build fails when the example no longer has these lines, so catch it before a docker build.
    let example = std::fs::read_to_string(repo_path("policies.yaml")).expect("read");
    assert!(example
        .lines()
        .any(|l| l.starts_with("listen: 127.0.0.1:8080")));
    assert!(example
        .lines()
        .any(|l| l.starts_with("admin_listen: 127.0.0.1:9901")));
    let dockerfile = std::fs::read_to_string(repo_path("Dockerfile")).expect("read");
    assert!(dockerfile.contains(r"-e 's/^admin_listen: 127\.0\.0\.1:/admin_listen: 0.0.0.0:/'"));
    assert!(dockerfile.contains(r#"CMD ["/usr/local/bin/turnstile", "healthcheck""#));
}

/// README's reference config (its first `yaml` block) loads as written: every line a user copies
/// from it is valid, and a repeated key (two `url:` under one upstream) is an error. The files it
/// names (its TLS certificate) are the user's own, so only their absence may be reported.
#[test]
fn the_readme_reference_config_loads() {
    let readme = std::fs::read_to_string(repo_path("README.md")).expect("README.md");
    let block = readme
        .split("```yaml\n")
        .nth(1)
        .and_then(|b| b.split("\n```").next())
        .expect("a yaml block in README.md");
    assert!(block.contains("routes:"), "the reference config:\n{block}");
    if let Err(errors) = turnstile::config::parse(block, std::path::Path::new("README.md")) {
        let text = errors.to_string();
        assert!(
            text.lines().all(|line| line.contains("cannot read `")),
            "README.md's reference config:\n{text}"
        );
    }
}

/// Every Turnstile config snippet in README.md and docs/ (a `yaml` block whose top-level keys are
/// the config's) loads. A fragment is completed as a reader would: a route when it has none, and
/// the upstream `api` when it names it without defining it. Only files the snippet names (TLS
/// certificates, JWT keys, an `rls:` directory) may be missing: they are the user's own.
#[test]
fn every_config_snippet_in_the_docs_loads() {
    const TOP: &[&str] = &[
        "routes",
        "server",
        "forward_auth",
        "ext_proc",
        "upstreams",
        "store",
        "jwt",
        "rls",
        "rlqs",
        "exempt",
        "client_ip",
        "listen",
        "admin_listen",
        "listen_tls",
        "overrides",
    ];
    let mut pages: Vec<std::path::PathBuf> = std::fs::read_dir(repo_path("docs"))
        .expect("docs/")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    pages.sort();
    pages.push(repo_path("README.md"));
    let mut checked = 0;
    for page in &pages {
        let text = std::fs::read_to_string(page).expect("page");
        for (i, block) in text.split("```yaml\n").skip(1).enumerate() {
            let Some((yaml, _)) = block.split_once("\n```") else {
                continue;
            };
            let is_config = yaml.lines().any(|line| {
                line.split_once(':')
                    .is_some_and(|(key, _)| TOP.contains(&key))
            });
            if !is_config {
                continue;
            }
            let mut full = yaml.to_string();
            if !yaml.lines().any(|l| {
                l.starts_with("routes:") || l.starts_with("rls:") || l.starts_with("rlqs:")
            }) {
                full.push_str("\nroutes:\n  - name: snippet\n    respond: { status: 200 }\n");
            }
            if yaml.contains("upstream: api") && !yaml.lines().any(|l| l.starts_with("upstreams:"))
            {
                full.push_str("\nupstreams:\n  api: { url: \"http://127.0.0.1:3000\" }\n");
            }
            let name = format!("{}, yaml block {}", page.display(), i + 1);
            if let Err(errors) = turnstile::config::parse(&full, std::path::Path::new(&name)) {
                let text = errors.to_string();
                assert!(
                    text.lines().all(|line| line.contains("cannot read")),
                    "{name}:\n{yaml}\n{text}"
                );
            }
            checked += 1;
        }
    }
    assert!(checked >= 15, "only {checked} config snippets found");
}

#[test]
fn compose_tracing_profile_adds_a_traced_gateway_a_collector_and_jaeger() {
    run_ok(
        "docker-compose",
        &[
            "-f",
            "docker-compose.yml",
            "--profile",
            "tracing",
            "config",
            "-q",
        ],
        INSTALL_COMPOSE,
    );
    let compose = resolved_compose();
    let services = compose["services"].as_object().expect("services");
    for name in ["turnstile-traced", "otel-collector", "jaeger"] {
        assert_eq!(
            services[name]["profiles"],
            serde_json::json!(["tracing"]),
            "{name} is in the tracing profile only"
        );
    }
    for name in ["redis", "api", "turnstile", "prometheus", "grafana"] {
        assert!(
            services[name]["profiles"].is_null(),
            "{name} runs without a profile"
        );
    }
    let volumes = services["turnstile-traced"]["volumes"].to_string();
    assert!(
        volumes.contains("deploy/compose/policies-tracing.yaml:/etc/turnstile/policies.yaml:ro"),
        "{volumes}"
    );
    let snapshot = turnstile::config::load(&repo_path("deploy/compose/policies-tracing.yaml"))
        .unwrap_or_else(|e| panic!("deploy/compose/policies-tracing.yaml:\n{e}"));
    let tracing = snapshot.tracing.expect("tracing on");
    assert_eq!(tracing.otlp_endpoint, "http://otel-collector:4317/");

    // The collector receives OTLP/gRPC where Turnstile sends it and forwards to Jaeger's OTLP port.
    let text =
        std::fs::read_to_string(repo_path("deploy/compose/otel-collector.yaml")).expect("read");
    let collector: Value = serde_norway::from_str(&text).expect("YAML");
    assert_eq!(
        collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"],
        "0.0.0.0:4317"
    );
    assert_eq!(collector["exporters"]["otlp"]["endpoint"], "jaeger:4317");
    assert_eq!(
        collector["service"]["pipelines"]["traces"]["exporters"],
        serde_json::json!(["otlp"])
    );
    assert_eq!(
        services["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"],
        "true"
    );
}
