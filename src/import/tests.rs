use super::emit::scalar;
use super::nginx::{go_duration, nginx_key, nginx_size, turnstile_size};
use super::order::fit;

#[test]
fn scalars_read_back_as_the_same_string() {
    for text in [
        "shop_web_80",
        "/api/{*rest}",
        "http://web.shop.svc.cluster.local:80",
        "10/s",
        "1m",
        "8MiB",
        "true",
        "null",
        "1e5",
        "0x1f",
        "",
        "a: b",
        "#x",
        "- y",
        "10.0.0.0/8",
        "::1/128",
        "host:",
        "quote\"and\\back",
        "line\nbreak",
        "*.example.com",
        "é",
    ] {
        let yaml = format!("v: {}\n", scalar(text));
        let back: std::collections::BTreeMap<String, String> =
            serde_norway::from_str(&yaml).unwrap_or_else(|e| panic!("{yaml}: {e}"));
        assert_eq!(back["v"], text, "{yaml}");
    }
}

#[test]
fn nginx_key_variables_become_key_parts() {
    assert_eq!(nginx_key("$remote_addr").unwrap(), ["client_ip"]);
    assert_eq!(
        nginx_key("${http_x_api_KEY}-$arg_tenant$remote_addr").unwrap(),
        ["header:x-api-key", "query:tenant", "client_ip"]
    );
    assert_eq!(
        nginx_key("$host$request_method").unwrap(),
        ["host", "method"]
    );
    assert!(nginx_key("$cookie_session")
        .unwrap_err()
        .contains("$cookie_session"));
    assert!(nginx_key("constant").is_err());
    assert!(nginx_key("${remote_addr").is_err());
}

#[test]
fn go_durations_become_turnstile_durations_in_their_largest_unit() {
    assert_eq!(go_duration("1m").as_deref(), Some("1m"));
    assert_eq!(go_duration("90s").as_deref(), Some("90s"));
    assert_eq!(go_duration("1h30m").as_deref(), Some("90m"));
    assert_eq!(go_duration("1.5h").as_deref(), Some("90m"));
    assert_eq!(go_duration("24h").as_deref(), Some("1d"));
    assert_eq!(go_duration("1500ms").as_deref(), Some("1500ms"));
    assert_eq!(go_duration("2s").as_deref(), Some("2s"));
    assert_eq!(go_duration("8760h").as_deref(), Some("365d"));
    for bad in ["", "10", "1w", "0s", "1500us", "m", "8761h"] {
        assert_eq!(go_duration(bad), None, "{bad}");
    }
}

#[test]
fn nginx_sizes_become_turnstile_sizes() {
    assert_eq!(nginx_size("8m"), Some(8 << 20));
    assert_eq!(nginx_size("512K"), Some(512 << 10));
    assert_eq!(nginx_size("1g"), Some(1 << 30));
    assert_eq!(nginx_size("1000"), Some(1000));
    assert_eq!(nginx_size("8mb"), None);
    assert_eq!(turnstile_size(8 << 20), "8MiB");
    assert_eq!(turnstile_size(1536 << 10), "1536KiB");
    assert_eq!(turnstile_size(1000), "1000B");
}

#[test]
fn names_fit_turnstile_rules_and_stay_unique_when_cut() {
    assert_eq!(fit("shop_storefront_0"), "shop_storefront_0");
    assert_eq!(fit("api.example.com_404"), "api-example-com_404");
    let long_a = fit(&format!("{}_a", "n".repeat(80)));
    let long_b = fit(&format!("{}_b", "n".repeat(80)));
    assert_eq!(long_a.len(), 64);
    assert_ne!(long_a, long_b);
}

fn import(files: &[(&str, &str)]) -> super::Imported {
    let files: Vec<(String, String)> = files
        .iter()
        .map(|(n, t)| (n.to_string(), t.to_string()))
        .collect();
    super::ingress_nginx(&files).unwrap_or_else(|e| panic!("{e}"))
}

fn loads(yaml: &str) -> crate::config::Snapshot {
    crate::config::parse(yaml, std::path::Path::new("p.yaml"))
        .unwrap_or_else(|e| panic!("{e}\n{yaml}"))
}

const INGRESS: &str =
    "apiVersion: networking.k8s.io/v1\nkind: Ingress\nmetadata:\n  name: web\n  namespace: shop\n";

#[test]
fn manifest_text_cannot_inject_yaml_through_paths_hosts_or_annotations() {
    let text = format!(
        "{INGRESS}  annotations:\n    nginx.ingress.kubernetes.io/rewrite-target: \"/x\\nlisten: 0.0.0.0:1\"\nspec:\n  rules:\n    - host: \"a.example.com\\nadmin_listen: 0.0.0.0:2\"\n      http:\n        paths:\n          - path: \"/p\\n  - name: evil\"\n            pathType: Exact\n            backend: {{ service: {{ name: web, port: {{ number: 80 }} }} }}\n"
    );
    let imported = import(&[("m.yaml", &text)]);
    let snapshot = loads(&imported.yaml);
    assert_eq!(snapshot.routes.len(), 1, "{}", imported.yaml);
    assert_eq!(
        snapshot.listen.expect("a plain listener").port(),
        8080,
        "the default listener: nothing injected"
    );
    assert!(!imported.yaml.contains("\nlisten"), "{}", imported.yaml);
    assert!(
        !imported.report().contains("\nlisten"),
        "{}",
        imported.report()
    );
}

#[test]
fn an_ingress_defined_twice_keeps_the_later_definition_and_says_so() {
    let rule = |svc: &str| {
        format!("spec:\n  rules:\n    - host: a.example.com\n      http:\n        paths:\n          - path: /\n            pathType: Prefix\n            backend: {{ service: {{ name: {svc}, port: {{ number: 80 }} }} }}\n")
    };
    let first = format!("{INGRESS}{}", rule("old"));
    let second = format!("{INGRESS}{}", rule("new"));
    let imported = import(&[("a.yaml", &first), ("b.yaml", &second)]);
    assert_eq!(imported.ingresses, 1);
    assert!(
        imported
            .yaml
            .contains("url: http://new.shop.svc.cluster.local:80"),
        "{}",
        imported.yaml
    );
    assert!(!imported.yaml.contains("old"), "{}", imported.yaml);
    assert!(
        imported.report().contains(
            "shop/web: defined again in b.yaml: document 1; the later definition is used"
        ),
        "{}",
        imported.report()
    );
}

#[test]
fn the_same_input_gives_the_same_bytes() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/import/11-canary-default-backend.yaml"
    ))
    .expect("corpus");
    let a = import(&[("x.yaml", &text)]);
    let b = import(&[("x.yaml", &text)]);
    assert_eq!(a.yaml, b.yaml);
    assert_eq!(a.report(), b.report());
}

#[test]
fn a_small_proxy_body_size_never_lowers_the_default_of_the_other_ingresses() {
    let ingress = |name: &str, annotation: &str| {
        format!("apiVersion: networking.k8s.io/v1\nkind: Ingress\nmetadata:\n  name: {name}\n  annotations: {{ {annotation} }}\nspec:\n  rules:\n    - host: {name}.example.com\n      http:\n        paths:\n          - path: /\n            pathType: Prefix\n            backend: {{ service: {{ name: {name}, port: {{ number: 80 }} }} }}\n")
    };
    let small = ingress("small", "nginx.ingress.kubernetes.io/proxy-body-size: 512k");
    let plain = ingress("plain", "");
    let imported = import(&[("a.yaml", &small), ("b.yaml", &plain)]);
    assert_eq!(
        loads(&imported.yaml).server.max_body_size,
        1 << 20,
        "{}",
        imported.yaml
    );
    assert!(
        imported
            .yaml
            .contains("max_body_size: 1MiB  # proxy-body-size of the default 1m"),
        "{}",
        imported.yaml
    );
    assert!(
        imported.report().contains("default/small: nginx.ingress.kubernetes.io/proxy-body-size=\"512k\": Turnstile's body limit is global"),
        "{}",
        imported.report()
    );
    let alone = import(&[("a.yaml", &small)]);
    assert_eq!(loads(&alone.yaml).server.max_body_size, 512 << 10);
}

fn ingress_with(annotations: &str, path: &str, kind: &str) -> String {
    format!("{INGRESS}  annotations: {{ {annotations} }}\nspec:\n  rules:\n    - host: a.example.com\n      http:\n        paths:\n          - path: \"{path}\"\n            pathType: {kind}\n            backend: {{ service: {{ name: web, port: {{ number: 8443 }} }} }}\n")
}

#[test]
fn limit_connections_becomes_a_concurrency_policy_per_client_ip() {
    let text = ingress_with(
        "nginx.ingress.kubernetes.io/limit-connections: \"7\"",
        "/",
        "Prefix",
    );
    let imported = import(&[("m.yaml", &text)]);
    assert!(
        imported.yaml.contains(
            "      - name: shop_web_connections\n        shared: true\n        key: [client_ip]\n        concurrency: { limit: 7 }\n"
        ),
        "{}",
        imported.yaml
    );
    loads(&imported.yaml);
    assert!(
        !imported.report().contains("limit-connections"),
        "{}",
        imported.report()
    );
}

#[test]
fn backend_protocol_https_becomes_an_https_upstream_verified_only_with_proxy_ssl_verify() {
    let https = ingress_with(
        "nginx.ingress.kubernetes.io/backend-protocol: HTTPS",
        "/",
        "Prefix",
    );
    let imported = import(&[("m.yaml", &https)]);
    assert!(
        imported.yaml.contains(
            "  shop_web_8443_https:\n    url: https://web.shop.svc.cluster.local:8443\n    tls_verify: false"
        ),
        "{}",
        imported.yaml
    );
    let snapshot = loads(&imported.yaml);
    assert_eq!(snapshot.routes.len(), 1);
    assert!(
        !imported.report().contains("backend-protocol"),
        "{}",
        imported.report()
    );

    let verified = ingress_with(
        "nginx.ingress.kubernetes.io/backend-protocol: HTTPS, nginx.ingress.kubernetes.io/proxy-ssl-verify: \"on\"",
        "/",
        "Prefix",
    );
    let imported = import(&[("m.yaml", &verified)]);
    assert!(
        imported
            .yaml
            .contains("    url: https://web.shop.svc.cluster.local:8443\n\nroutes:"),
        "{}",
        imported.yaml
    );
    assert!(!imported.yaml.contains("tls_verify"), "{}", imported.yaml);
    loads(&imported.yaml);
}

#[test]
fn rewrite_target_maps_the_exact_regex_shapes_and_reports_the_rest() {
    use super::translate::{rewrite, PathOut};
    assert_eq!(
        rewrite("/something(/|$)(.*)", "ImplementationSpecific", "/$2"),
        Ok((
            PathOut::Pattern("/something/{*rest}".to_string()),
            "/{*rest}".to_string()
        ))
    );
    assert_eq!(
        rewrite("/a/b(/|$)(.*)", "Prefix", "/v2/$2"),
        Ok((
            PathOut::Pattern("/a/b/{*rest}".to_string()),
            "/v2/{*rest}".to_string()
        ))
    );
    assert_eq!(
        rewrite("/app", "Prefix", "/"),
        Ok((PathOut::Prefix("/app".to_string()), "/".to_string()))
    );
    for (path, kind, target) in [
        ("/something(/|$)(.*)", "ImplementationSpecific", "/$1"),
        ("/v[0-9]+/(.*)", "ImplementationSpecific", "/$1"),
        ("/api/(.*)", "Prefix", "/$1"),
        ("/app", "Prefix", "/$1"),
        ("/app", "Exact", "/"),
        ("/a(/|$)(.*)", "Prefix", "http://elsewhere/$2"),
        ("/a.b(/|$)(.*)", "Prefix", "/$2"),
    ] {
        assert!(
            rewrite(path, kind, target).is_err(),
            "{path} {kind} {target}"
        );
    }
    let text = ingress_with(
        "nginx.ingress.kubernetes.io/rewrite-target: /$2",
        "/something(/|$)(.*)",
        "ImplementationSpecific",
    );
    let imported = import(&[("m.yaml", &text)]);
    assert!(
        imported
            .yaml
            .contains("      path: \"/something/{*rest}\"\n    upstream: shop_web_8443\n    rewrite: \"/{*rest}\"\n"),
        "{}",
        imported.yaml
    );
    assert_eq!(loads(&imported.yaml).routes.len(), 1);
}

#[test]
fn a_rewrite_target_equal_to_the_path_rewrites_nothing_as_in_ingress_nginx() {
    let text = ingress_with(
        "nginx.ingress.kubernetes.io/rewrite-target: /",
        "/",
        "Prefix",
    );
    let imported = import(&[("m.yaml", &text)]);
    assert!(!imported.yaml.contains("rewrite"), "{}", imported.yaml);
    assert!(imported.notes.is_empty(), "{}", imported.report());
}

/// Each Ingress has its own shared budget, also when two Ingress names clean to one policy name
/// (`a.b` and `a-b`): the later in namespace/name order (`a.b`) gets a digest, so neither shares
/// the other's counter.
#[test]
fn every_ingress_shares_its_own_budget_across_its_paths() {
    let two = |name: &str, rps: u32, host: &str| {
        format!("apiVersion: networking.k8s.io/v1\nkind: Ingress\nmetadata:\n  name: {name}\n  namespace: shop\n  annotations: {{ nginx.ingress.kubernetes.io/limit-rps: \"{rps}\" }}\nspec:\n  rules:\n    - host: {host}\n      http:\n        paths:\n          - {{ path: /x, pathType: Prefix, backend: {{ service: {{ name: web, port: {{ number: 80 }} }} }} }}\n          - {{ path: /y, pathType: Prefix, backend: {{ service: {{ name: web, port: {{ number: 80 }} }} }} }}\n")
    };
    let text = format!(
        "{}---\n{}",
        two("a.b", 5, "one.example"),
        two("a-b", 7, "two.example")
    );
    let imported = import(&[("m.yaml", &text)]);
    let snapshot = loads(&imported.yaml);
    let prefixes: Vec<(&str, &str)> = snapshot
        .routes
        .iter()
        .map(|r| (&*r.name, r.policies[0].key_prefix()))
        .collect();
    let digest = super::order::with_digest("shop_a.b_rps");
    let shared = format!("shared/{digest}:");
    assert_eq!(
        prefixes,
        [
            ("shop_a-b_0", shared.as_str()),
            ("shop_a-b_1", shared.as_str()),
            ("shop_a-b_0-2", "shared/shop_a-b_rps:"),
            ("shop_a-b_1-3", "shared/shop_a-b_rps:"),
        ],
        "{}",
        imported.yaml
    );
    assert!(
        !imported.report().contains("share"),
        "{}",
        imported.report()
    );
}
