//! Kubernetes manifests in: multi-document YAML files, `kind: List` included (what `kubectl get -o
//! yaml` writes). Only `networking.k8s.io/v1` Ingresses are translated; `v1` Services are read for
//! the numbers of named ports; every other kind is counted as ignored.
//!
//! The shapes below are lenient (no `deny_unknown_fields`): Kubernetes objects carry many fields
//! (status, managedFields, ...) that do not concern routing.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_norway::Value;

use super::ImportError;

#[derive(Debug, Clone, Deserialize)]
pub struct Metadata {
    pub name: String,
    pub namespace: Option<String>,
    /// Values are strings in Kubernetes; an unquoted `limit-rps: 5` is accepted too.
    #[serde(default)]
    pub annotations: BTreeMap<String, Value>,
}

impl Metadata {
    pub fn namespace(&self) -> &str {
        self.namespace.as_deref().unwrap_or("default")
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct Ingress {
    pub metadata: Metadata,
    #[serde(default)]
    pub spec: IngressSpec,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct IngressSpec {
    pub ingress_class_name: Option<String>,
    pub default_backend: Option<Backend>,
    #[serde(default)]
    pub rules: Vec<Rule>,
    #[serde(default)]
    pub tls: Vec<Value>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Rule {
    pub host: Option<String>,
    pub http: Option<HttpRule>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct HttpRule {
    #[serde(default)]
    pub paths: Vec<HttpPath>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpPath {
    pub path: Option<String>,
    pub path_type: Option<String>,
    pub backend: Backend,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Backend {
    pub service: Option<ServiceBackend>,
    pub resource: Option<Value>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ServiceBackend {
    pub name: String,
    pub port: Option<ServicePort>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ServicePort {
    pub number: Option<u16>,
    pub name: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
struct Service {
    metadata: Metadata,
    #[serde(default)]
    spec: ServiceSpec,
}

#[derive(Debug, Clone, Default, Deserialize)]
struct ServiceSpec {
    #[serde(default)]
    ports: Vec<ServicePortSpec>,
}

#[derive(Debug, Clone, Deserialize)]
struct ServicePortSpec {
    name: Option<String>,
    port: u16,
}

/// The annotation that named an Ingress's class before `spec.ingressClassName`.
pub const CLASS_ANNOTATION: &str = "kubernetes.io/ingress.class";

impl Ingress {
    /// The Ingress's class and where it is written, as ingress-nginx reads it:
    /// `spec.ingressClassName` first, then the annotation; `None` without either.
    pub fn class(&self) -> Option<(String, &'static str)> {
        if let Some(name) = &self.spec.ingress_class_name {
            return Some((name.clone(), "spec.ingressClassName"));
        }
        self.metadata
            .annotations
            .get(CLASS_ANNOTATION)
            .and_then(annotation_text)
            .map(|c| (c, CLASS_ANNOTATION))
    }
}

/// Everything read from the input files.
#[derive(Debug, Default)]
pub struct Manifests {
    /// In input order, with the file each came from.
    pub ingresses: Vec<(Ingress, String)>,
    /// (namespace, service, port name) → port number.
    pub named_ports: BTreeMap<(String, String, String), u16>,
    /// `apiVersion kind` → how many objects were not read.
    pub ignored: BTreeMap<String, usize>,
}

impl Manifests {
    /// Reads one file's documents; `file` names it in errors.
    pub fn read(&mut self, file: &str, text: &str) -> Result<(), ImportError> {
        for (index, document) in serde_norway::Deserializer::from_str(text).enumerate() {
            let at = || format!("{file}: document {}", index + 1);
            let value = Value::deserialize(document).map_err(|e| ImportError {
                message: format!("{}: not YAML: {e}", at()),
            })?;
            self.object(value, &at)?;
        }
        Ok(())
    }

    fn object(&mut self, value: Value, at: &dyn Fn() -> String) -> Result<(), ImportError> {
        if value.is_null() {
            return Ok(());
        }
        let field = |name: &str| value.get(name).and_then(Value::as_str).unwrap_or("");
        let (api_version, kind) = (field("apiVersion").to_string(), field("kind").to_string());
        let invalid = |e: serde_norway::Error| ImportError {
            message: format!("{}: not a valid {api_version} {kind}: {e}", at()),
        };
        match (api_version.as_str(), kind.as_str()) {
            ("networking.k8s.io/v1", "Ingress") => {
                let ingress: Ingress = serde_norway::from_value(value).map_err(invalid)?;
                self.ingresses.push((ingress, at()));
            }
            ("v1", "Service") => {
                let service: Service = serde_norway::from_value(value).map_err(invalid)?;
                let ns = service.metadata.namespace().to_string();
                for port in service.spec.ports {
                    if let Some(name) = port.name {
                        let key = (ns.clone(), service.metadata.name.clone(), name);
                        self.named_ports.insert(key, port.port);
                    }
                }
            }
            (_, "List") | (_, "IngressList") => {
                if let Some(Value::Sequence(items)) = value.get("items") {
                    for item in items.clone() {
                        self.object(item, at)?;
                    }
                }
            }
            ("", "") => {
                return Err(ImportError {
                    message: format!("{}: not a Kubernetes object (no apiVersion and kind)", at()),
                })
            }
            _ => {
                *self
                    .ignored
                    .entry(format!("{api_version} {kind}"))
                    .or_default() += 1
            }
        }
        Ok(())
    }
}

/// An annotation's value as text: strings as they are, numbers and booleans as written.
pub fn annotation_text(value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}
