//! The Kubernetes manifests (`deploy/kubernetes`), checked without a cluster: both kustomizations
//! render with `kubectl kustomize`, every rendered object validates against the Kubernetes schemas
//! offline (PyPI `kubernetes-validate`, strict: unknown fields are errors), the config in each
//! ConfigMap passes `turnstile check`, and the Deployment keeps the properties the docs promise.

mod support;

use serde_json::Value;

use support::tools::run_ok;

const INSTALL_KUBECTL: &str = "kubectl (Debian: apt-get install kubernetes-client)";
const INSTALL_VALIDATE: &str = "PyPI: pip install kubernetes-validate";

/// `kubectl kustomize DIR`, as text and as objects.
fn render(dir: &str) -> (String, Vec<Value>) {
    let text = run_ok("kubectl", &["kustomize", dir], INSTALL_KUBECTL);
    let objects = serde_norway::Deserializer::from_str(&text)
        .map(|doc| <Value as serde::Deserialize>::deserialize(doc).expect("rendered YAML"))
        .collect();
    (text, objects)
}

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

fn validate(text: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("rendered.yaml");
    std::fs::write(&path, text).expect("write");
    run_ok(
        "kubernetes-validate",
        &["--strict", "--quiet", &path.display().to_string()],
        INSTALL_VALIDATE,
    );
}

/// Writes the ConfigMap's `policies.yaml` and runs the real binary's `check` on it.
fn check_config(configmap: &Value) -> String {
    let text = configmap["data"]["policies.yaml"]
        .as_str()
        .expect("policies.yaml in the ConfigMap");
    let (_dir, path) = support::process::config_file(text);
    let (code, stdout, stderr) = support::process::check(&path);
    assert_eq!(code, Some(0), "turnstile check: {stdout}{stderr}");
    text.to_string()
}

#[test]
fn the_base_renders_validates_and_runs_hardened() {
    let (text, objects) = render("deploy/kubernetes");
    validate(&text);
    let kinds: Vec<&str> = objects.iter().filter_map(|o| o["kind"].as_str()).collect();
    for kind in ["ConfigMap", "Deployment", "Service", "PodDisruptionBudget"] {
        assert!(kinds.contains(&kind), "{kind} in {kinds:?}");
    }
    let config = check_config(find(&objects, "ConfigMap", "turnstile-config"));
    assert!(
        config.contains("admin_listen: 0.0.0.0:9901"),
        "the probes reach the admin port"
    );

    let deployment = find(&objects, "Deployment", "turnstile");
    let pod = &deployment["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(container["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(
        container["securityContext"]["allowPrivilegeEscalation"],
        false
    );
    assert!(container["resources"]["requests"]["cpu"].is_string());
    assert!(container["resources"]["requests"]["memory"].is_string());
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(container["readinessProbe"]["httpGet"]["port"], "admin");
    assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/healthz");
    let admin_port = container["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .find(|p| p["name"] == "admin")
        .expect("an admin port");
    assert_eq!(admin_port["containerPort"], 9901);
    // The whole directory is mounted (a subPath mount would never see ConfigMap updates), where
    // the container's arguments read the file.
    let mount = &container["volumeMounts"][0];
    assert!(mount["subPath"].is_null(), "no subPath: {mount}");
    let args: Vec<&str> = container["args"]
        .as_array()
        .expect("args")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let config_arg = args.last().expect("a config path");
    assert!(
        config_arg.starts_with(mount["mountPath"].as_str().expect("mountPath")),
        "{config_arg} under {mount}"
    );

    // The Service exposes only the public listener.
    let service = find(&objects, "Service", "turnstile");
    let ports = service["spec"]["ports"].as_array().expect("ports");
    assert_eq!(ports.len(), 1);
    assert_eq!(ports[0]["targetPort"], "http");
    // The Service and the PodDisruptionBudget select the Deployment's pods.
    let labels = &deployment["spec"]["template"]["metadata"]["labels"];
    assert_eq!(&service["spec"]["selector"], labels);
    let pdb = find(&objects, "PodDisruptionBudget", "turnstile");
    assert_eq!(&pdb["spec"]["selector"]["matchLabels"], labels);
}

#[test]
fn the_redis_overlay_renders_validates_and_shares_one_store() {
    let (text, objects) = render("deploy/kubernetes/overlays/redis");
    validate(&text);
    let config = check_config(find(&objects, "ConfigMap", "turnstile-config"));
    assert!(config.contains("type: redis"), "{config}");
    assert!(
        config.contains("url: redis://turnstile-redis:6379"),
        "{config}"
    );
    let deployment = find(&objects, "Deployment", "turnstile");
    assert_eq!(deployment["spec"]["replicas"], 3);
    // The Redis the config names exists, and Turnstile's Service does not select its pod.
    let redis = find(&objects, "Service", "turnstile-redis");
    assert_eq!(redis["spec"]["ports"][0]["port"], 6379);
    let service = find(&objects, "Service", "turnstile");
    let redis_labels =
        &find(&objects, "Deployment", "turnstile-redis")["spec"]["template"]["metadata"]["labels"];
    for (key, value) in service["spec"]["selector"].as_object().expect("selector") {
        assert_ne!(&redis_labels[key], value, "the Service would select Redis");
    }
}
