//! `docs/ingress.md` shows the files of `deploy/ingress/` verbatim (the proxy tests run them), and
//! the Kubernetes examples are well-formed.

use serde_json::Value;

use crate::support::tools::{repo_path, run_ok};

const EXAMPLES: &[&str] = &[
    "nginx-http.conf",
    "nginx-server.conf",
    "ingress-nginx.yaml",
    "traefik-dynamic.yml",
    "traefik-middleware.yaml",
    "Caddyfile.site",
    "envoy-ext-authz.yaml",
    "envoy-gateway-securitypolicy.yaml",
];

fn read(relative: &str) -> String {
    std::fs::read_to_string(repo_path(relative)).unwrap_or_else(|e| panic!("{relative}: {e}"))
}

fn documents(name: &str) -> Vec<Value> {
    let text = read(&format!("deploy/ingress/{name}"));
    text.split("\n---\n")
        .map(|doc| serde_norway::from_str::<Value>(doc).unwrap_or_else(|e| panic!("{name}: {e}")))
        .collect()
}

#[test]
fn the_page_shows_every_example_verbatim() {
    let page = read("docs/ingress.md");
    for name in EXAMPLES {
        let text = read(&format!("deploy/ingress/{name}"));
        let fenced = format!("\n{}\n```", text.trim_end());
        assert!(
            page.contains(&fenced),
            "docs/ingress.md does not show {name}"
        );
    }
}

#[test]
fn the_ingress_nginx_example_validates_and_asks_for_a_403_turned_into_a_429() {
    run_ok(
        "kubernetes-validate",
        &[
            "--strict",
            "--quiet",
            &repo_path("deploy/ingress/ingress-nginx.yaml")
                .display()
                .to_string(),
        ],
        "PyPI: pip install kubernetes-validate",
    );
    let ingress = &documents("ingress-nginx.yaml")[0];
    let annotations = &ingress["metadata"]["annotations"];
    let url = annotations["nginx.ingress.kubernetes.io/auth-url"]
        .as_str()
        .expect("auth-url");
    assert!(url.ends_with("/check?deny_status=403"), "{url}");
    let copied = annotations["nginx.ingress.kubernetes.io/auth-response-headers"]
        .as_str()
        .expect("auth-response-headers");
    assert!(copied.contains("X-RateLimit-Remaining"));
    let snippet = annotations["nginx.ingress.kubernetes.io/configuration-snippet"]
        .as_str()
        .expect("configuration-snippet");
    assert!(snippet.contains("error_page 403 = @ratelimited;"));
    let server = annotations["nginx.ingress.kubernetes.io/server-snippet"]
        .as_str()
        .expect("server-snippet");
    assert!(server.contains("return 429"));
}

#[test]
fn the_traefik_and_envoy_gateway_resources_point_at_the_check_listeners() {
    let traefik = documents("traefik-middleware.yaml");
    let middleware = traefik
        .iter()
        .find(|d| d["kind"] == "Middleware")
        .expect("a Middleware");
    assert_eq!(middleware["apiVersion"], "traefik.io/v1alpha1");
    let address = middleware["spec"]["forwardAuth"]["address"]
        .as_str()
        .expect("forwardAuth.address");
    assert!(address.ends_with(":8082/check"), "{address}");
    let route = traefik
        .iter()
        .find(|d| d["kind"] == "IngressRoute")
        .expect("an IngressRoute");
    assert_eq!(
        route["spec"]["routes"][0]["middlewares"][0]["name"],
        middleware["metadata"]["name"]
    );

    let policy = &documents("envoy-gateway-securitypolicy.yaml")[0];
    assert_eq!(policy["apiVersion"], "gateway.envoyproxy.io/v1alpha1");
    assert_eq!(policy["kind"], "SecurityPolicy");
    let backend = &policy["spec"]["extAuth"]["grpc"]["backendRefs"][0];
    assert_eq!(backend["port"], 8083);
}

/// Every Turnstile config on the page (a YAML block with `forward_auth:` or `routes:`) loads.
#[test]
fn the_pages_turnstile_configs_load() {
    let page = read("docs/ingress.md");
    let mut loaded = 0;
    for block in page.split("```yaml\n").skip(1) {
        let Some((yaml, _)) = block.split_once("\n```") else {
            continue;
        };
        if !yaml.contains("forward_auth:") {
            continue;
        }
        turnstile::config::parse(yaml, std::path::Path::new("docs/ingress.md"))
            .unwrap_or_else(|e| panic!("docs/ingress.md:\n{yaml}\n{e}"));
        loaded += 1;
    }
    assert!(loaded >= 1, "no Turnstile config found on the page");
}
