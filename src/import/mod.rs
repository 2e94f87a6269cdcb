//! `turnstile import ingress-nginx`: Kubernetes Ingress manifests and their ingress-nginx
//! annotations in, a `policies.yaml` and a report of everything not mapped exactly out.
//!
//! A pure translation, in four steps:
//!
//! - [`manifest`] reads the multi-document YAML into Ingresses (and Services, for named ports);
//! - [`annotations`] turns one Ingress's annotations into policies, exemptions and notes;
//!   [`nginx`] reads the values written in nginx's own small languages;
//! - [`translate`] turns rules into routes and upstreams, and [`order`] sorts them in nginx's
//!   precedence order;
//! - [`emit`] writes the document as YAML text, deterministically, with comments.
//!
//! The mapping and how its semantics compare with nginx's are explained in `docs/migration.md`.

pub mod annotations;
pub mod emit;
pub mod manifest;
pub mod nginx;
pub mod order;
pub mod translate;

use std::fmt;

/// Input that cannot be translated at all (unreadable YAML, a malformed Ingress).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ImportError {
    pub message: String,
}

/// One thing the import could not map exactly, about one Ingress (`namespace/name`) or the input.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Note {
    pub subject: String,
    pub text: String,
}

impl fmt::Display for Note {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.subject, self.text)
    }
}

/// The result of an import: the config text and the report.
#[derive(Debug, Clone)]
pub struct Imported {
    pub yaml: String,
    pub notes: Vec<Note>,
    pub ingresses: usize,
    pub routes: usize,
    pub upstreams: usize,
}

impl Imported {
    /// The report for stderr: a summary line, then one line per note.
    pub fn report(&self) -> String {
        let n = |count: usize, one: &str, many: &str| match count {
            1 => format!("1 {one}"),
            _ => format!("{count} {many}"),
        };
        let mut out = format!(
            "turnstile import: {} -> {}, {}; {}\n",
            n(self.ingresses, "Ingress", "Ingresses"),
            n(self.routes, "route", "routes"),
            n(self.upstreams, "upstream", "upstreams"),
            n(self.notes.len(), "note", "notes"),
        );
        for note in &self.notes {
            // One line per note, whatever the manifests' strings hold.
            out.push_str(&format!("  {}\n", emit::comment(&note.to_string())));
        }
        out
    }
}

/// Which Ingresses to import.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// `--ingress-class NAME`: only Ingresses of this class (`spec.ingressClassName`, else the
    /// `kubernetes.io/ingress.class` annotation); `None` imports every Ingress.
    pub ingress_class: Option<String>,
    /// `--watch-ingress-without-class`: with `ingress_class`, also the Ingresses that name no
    /// class, as the ingress-nginx controller flag of that name (off by default, as there).
    pub without_class: bool,
}

/// Translates `files` (name, text) of Kubernetes manifests for ingress-nginx, every Ingress.
pub fn ingress_nginx(files: &[(String, String)]) -> Result<Imported, ImportError> {
    ingress_nginx_with(files, &Options::default())
}

/// Translates `files` (name, text) of Kubernetes manifests for ingress-nginx, the Ingresses
/// `options` select.
pub fn ingress_nginx_with(
    files: &[(String, String)],
    options: &Options,
) -> Result<Imported, ImportError> {
    let mut manifests = manifest::Manifests::default();
    for (name, text) in files {
        manifests.read(name, text)?;
    }
    if manifests.ingresses.is_empty() {
        return Err(ImportError {
            message: "no networking.k8s.io/v1 Ingress in the input".to_string(),
        });
    }
    let document = translate::translate(&manifests, options);
    if document.ingresses == 0 {
        let class = options.ingress_class.as_deref().unwrap_or_default();
        let report: Vec<String> = document.notes.iter().map(ToString::to_string).collect();
        return Err(ImportError {
            message: format!(
                "no networking.k8s.io/v1 Ingress of class `{class}` in the input; the report:\n  {}",
                report.join("\n  ")
            ),
        });
    }
    let sources: Vec<&str> = files.iter().map(|(name, _)| name.as_str()).collect();
    Ok(Imported {
        yaml: emit::yaml(&document, &sources),
        ingresses: document.ingresses,
        routes: document.routes.len(),
        upstreams: document.upstreams.len(),
        notes: document.notes,
    })
}

#[cfg(test)]
mod tests;
