//! Reading envoyproxy/ratelimit's YAML files: from a file or a directory, through the marked YAML
//! tree, into checked raw descriptors that `tree.rs` compiles.
//!
//! The format, one domain per file:
//!
//! ```yaml
//! domain: my-domain
//! algorithm: fixed_window          # extension, optional: the domain's default (see below)
//! descriptors:
//!   - key: remote_address          # required
//!     value: 10.0.0.1              # optional; `*` anywhere makes it a wildcard
//!     rate_limit:                  # optional; no limit and no children whitelists
//!       unit: second               # second|minute|hour|day|week|month|year, any case
//!       requests_per_unit: 5
//!       unlimited: false           # true: never limited (then no unit)
//!       name: per-ip               # what `replaces` refers to
//!       replaces: [{name: other}]  # drop these limits from the same request
//!       algorithm: sliding_window  # extension: sliding_window (default) | fixed_window
//!       unit_multiplier: 5         # extension: the window is 5 units (default 1)
//!     token_bucket:                # extension, instead of rate_limit
//!       unit: second
//!       requests_per_unit: 10      # refill rate
//!       burst: 20                  # bucket size (default: requests_per_unit)
//!       name: ...                  # and replaces, as in rate_limit
//!     shadow_mode: false
//!     detailed_metric: false
//!     share_threshold: false       # a wildcard's matches share one counter
//!     value_to_metric: false       # the metric names this level by the request's value
//!     metadata: {...}              # free-form, ignored
//!     descriptors: [...]           # nested
//! ```
//!
//! Any other key is an error, as in envoyproxy/ratelimit; messages keep its wording, prefixed with
//! `file:line:` and followed by the field's path.

use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};

use super::read::Reader;
use super::rule::Unit;
use super::tree::{LoadOptions, RlsConfig};
use super::yaml::{self, Node, Value};

/// Why an envoyproxy/ratelimit config could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum RlsConfigError {
    #[error("{}: cannot read: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: the directory has no *.yaml or *.yml file", path.display())]
    NoFiles { path: PathBuf },
    /// A file whose content is wrong: where, what, and (when one is to blame) which field.
    #[error("{file}:{line}: {message}{}", FieldSuffix(field.as_deref()))]
    Invalid {
        file: String,
        line: usize,
        field: Option<String>,
        message: String,
    },
}

struct FieldSuffix<'a>(Option<&'a str>);

impl fmt::Display for FieldSuffix<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(field) if !field.is_empty() => write!(f, " (field {field})"),
            _ => Ok(()),
        }
    }
}

/// Extension: how a windowed `rate_limit` is enforced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WindowKind {
    Sliding,
    Fixed,
}

/// One file, checked but not yet compiled.
#[derive(Debug)]
pub(crate) struct RawFile {
    pub(crate) name: String,
    pub(crate) domain: String,
    pub(crate) domain_line: usize,
    pub(crate) algorithm: Option<WindowKind>,
    pub(crate) descriptors: Vec<RawDescriptor>,
}

#[derive(Debug)]
pub(crate) struct RawDescriptor {
    pub(crate) line: usize,
    pub(crate) field: String,
    pub(crate) key: String,
    pub(crate) value: Option<String>,
    pub(crate) limit: Option<RawLimit>,
    pub(crate) shadow_mode: bool,
    /// Over its limit, the descriptor is OVER_LIMIT but the request is refused only when every
    /// quota descriptor of it is (or a non-quota one is over).
    pub(crate) quota_mode: bool,
    pub(crate) metadata: Option<envoy_types::pb::google::protobuf::Struct>,
    pub(crate) detailed_metric: bool,
    pub(crate) share_threshold: bool,
    pub(crate) value_to_metric: bool,
    pub(crate) descriptors: Vec<RawDescriptor>,
}

#[derive(Debug)]
pub(crate) struct RawLimit {
    pub(crate) line: usize,
    pub(crate) name: Option<String>,
    pub(crate) replaces: Vec<String>,
    pub(crate) requests_per_unit: u32,
    pub(crate) unit: Option<Unit>,
    /// `unit_multiplier` (an extension proposed upstream, envoyproxy/ratelimit#190): the window
    /// is this many units; 1 when absent, envoyproxy/ratelimit's meaning.
    pub(crate) unit_multiplier: u32,
    pub(crate) kind: RawKind,
}

#[derive(Debug)]
pub(crate) enum RawKind {
    Unlimited,
    Window(Option<WindowKind>),
    TokenBucket { burst: u32 },
}

impl RlsConfig {
    /// Loads `path`: one file, or every `*.yaml`/`*.yml` file directly in a directory, in name
    /// order (the order decides which file a duplicate is reported in).
    pub fn load(path: &Path, options: LoadOptions) -> Result<RlsConfig, RlsConfigError> {
        let read_err = |source| RlsConfigError::Read {
            path: path.to_owned(),
            source,
        };
        let files = if fs::metadata(path).map_err(read_err)?.is_dir() {
            let mut files = Vec::new();
            for entry in fs::read_dir(path).map_err(read_err)? {
                let file = entry.map_err(read_err)?.path();
                let yaml = matches!(
                    file.extension().and_then(|e| e.to_str()),
                    Some("yaml" | "yml")
                );
                if yaml && file.is_file() {
                    files.push(file);
                }
            }
            if files.is_empty() {
                return Err(RlsConfigError::NoFiles {
                    path: path.to_owned(),
                });
            }
            files.sort();
            files
        } else {
            vec![path.to_owned()]
        };
        Self::load_files(&files, options)
    }

    /// Loads the given files, in this order.
    pub fn load_files(
        paths: &[PathBuf],
        options: LoadOptions,
    ) -> Result<RlsConfig, RlsConfigError> {
        let mut raw = Vec::with_capacity(paths.len());
        for path in paths {
            let text = fs::read_to_string(path).map_err(|source| RlsConfigError::Read {
                path: path.clone(),
                source,
            })?;
            raw.push(parse_file(&path.display().to_string(), &text)?);
        }
        RlsConfig::compile(raw, options)
    }

    /// Loads in-memory files, each a `(name, text)` pair; `name` is only used in errors.
    pub fn from_sources(
        sources: &[(&str, &str)],
        options: LoadOptions,
    ) -> Result<RlsConfig, RlsConfigError> {
        let raw = sources
            .iter()
            .map(|(name, text)| parse_file(name, text))
            .collect::<Result<Vec<_>, _>>()?;
        RlsConfig::compile(raw, options)
    }
}

/// Builds the error for `file` at `line`, blaming `field`.
pub(crate) fn invalid(file: &str, line: usize, field: &str, message: String) -> RlsConfigError {
    RlsConfigError::Invalid {
        file: file.to_owned(),
        line,
        field: (!field.is_empty()).then(|| field.to_owned()),
        message,
    }
}

/// Parses one file's text.
pub(crate) fn parse_file(name: &str, text: &str) -> Result<RawFile, RlsConfigError> {
    let docs = yaml::parse(text).map_err(|e| {
        invalid(
            name,
            e.line,
            "",
            format!(
                "error loading config file: {} (column {})",
                e.message, e.col
            ),
        )
    })?;
    if docs.len() > 1 {
        let message = "error loading config file: one YAML document per file".to_owned();
        return Err(invalid(name, docs[1].line, "", message));
    }
    let reader = Reader { file: name };
    let empty = Node {
        line: 1,
        value: Value::Map(Vec::new()),
    };
    let root = docs.first().unwrap_or(&empty);
    // A file with only `descriptors:` is a mapping; a null document is an empty one.
    let root = match root.value {
        Value::Null => &empty,
        _ => root,
    };
    let fields = reader.map(root, "", &["domain", "descriptors", "algorithm"])?;
    let mut file = RawFile {
        name: name.to_owned(),
        domain: String::new(),
        domain_line: root.line,
        algorithm: None,
        descriptors: Vec::new(),
    };
    for (key, value) in fields {
        match key {
            "domain" => {
                file.domain = reader.string(value, "domain")?;
                file.domain_line = value.line;
            }
            "descriptors" => file.descriptors = reader.descriptors(value, "descriptors")?,
            _ => file.algorithm = Some(reader.window_kind(value, "algorithm")?),
        }
    }
    if file.domain.is_empty() {
        let message = "config file cannot have empty domain".to_owned();
        return Err(invalid(name, file.domain_line, "domain", message));
    }
    Ok(file)
}

/// `parent.name`, or `name` at the root.
pub(crate) fn join(parent: &str, name: &str) -> String {
    if parent.is_empty() {
        name.to_owned()
    } else {
        format!("{parent}.{name}")
    }
}
