//! Configuration: `policies.yaml` in, an immutable [`Snapshot`] out.
//!
//! Loading is three steps: serde reads the YAML into the raw shape ([`raw`]), [`compile`] validates
//! it into runtime types, and every error is located in the source ([`locate`]) so it reads
//! `FILE:LINE:COL: field.path: what is wrong and what is allowed`.

pub mod compile;
pub mod limited;
pub mod locate;
pub mod observability;
pub mod overrides;
pub mod ratelimit_env;
pub mod raw;
pub mod rewrite;
pub mod rlqs;
pub mod rls;
pub mod snapshot;
pub mod source;
pub mod tls;
pub mod usage;
pub use crate::units;

use std::fmt;
use std::path::{Path, PathBuf};

pub use snapshot::*;
pub use source::{ReloadStatus, SourceInfo};

use locate::Positions;

/// One located config problem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub file: PathBuf,
    pub line: usize,
    pub column: usize,
    /// The field path, e.g. `routes[0].policies[1].token_bucket.rate`; empty for the document.
    pub field: String,
    pub message: String,
}

impl ConfigError {
    /// An error at `line`:`column` of `file`, on `field` (empty for the document).
    pub fn at(file: &Path, line: usize, column: usize, field: String, message: String) -> Self {
        ConfigError {
            file: file.to_path_buf(),
            line,
            column,
            field,
            message,
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}: ", self.file.display(), self.line, self.column)?;
        if !self.field.is_empty() {
            write!(f, "{}: ", self.field)?;
        }
        f.write_str(&self.message)
    }
}

/// Every problem found in one config file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

/// Reads and validates the config at `path`: plain data, no pools and no metrics (see
/// [`crate::state::Live::attach`] for those).
pub fn load(path: &Path) -> Result<Snapshot, ConfigErrors> {
    let source = std::fs::read_to_string(path).map_err(|e| {
        ConfigErrors(vec![ConfigError {
            file: path.to_path_buf(),
            line: 0,
            column: 0,
            field: String::new(),
            message: format!("cannot read the config file: {e}"),
        }])
    })?;
    parse(&source, path)
}

/// Validates config text; `path` is only used to name the source in errors.
pub fn parse(source: &str, path: &Path) -> Result<Snapshot, ConfigErrors> {
    let positions = Positions::index(source);
    let error = |line, column, field, message| ConfigError::at(path, line, column, field, message);
    // serde reports a duplicate at the mapping that holds it; say where the second one is.
    if !positions.duplicates.is_empty() {
        return Err(ConfigErrors(
            positions
                .duplicates
                .iter()
                .map(|d| {
                    error(
                        d.again.line,
                        d.again.column,
                        d.path.clone(),
                        format!(
                            "given twice in one mapping (first at line {}); YAML keeps one value \
                             per key, so remove one",
                            d.first.line
                        ),
                    )
                })
                .collect(),
        ));
    }
    let raw: raw::RawConfig = match serde_norway::from_str(source) {
        Ok(raw) => raw,
        Err(e) => {
            // Two parsers read the text; the event parser's placement is used only when serde's
            // also fails, and only for an unclosed bracket, which serde places where it gave up.
            let placed = positions.unclosed.as_ref().map(|u| {
                error(
                    u.at.line,
                    u.at.column,
                    u.path.clone(),
                    format!(
                        "this `{}` is never closed: {} (the parser gave up at {}:{})",
                        u.bracket, u.message, u.stopped.line, u.stopped.column
                    ),
                )
            });
            return Err(ConfigErrors(vec![
                placed.unwrap_or_else(|| serde_error(&e, path))
            ]));
        }
    };
    let locate = |errors: Vec<compile::FieldError>| -> Vec<ConfigError> {
        errors
            .into_iter()
            .map(|e| {
                let pos = positions.find(&e.path);
                ConfigError {
                    file: path.to_path_buf(),
                    line: pos.map_or(1, |p| p.line),
                    column: pos.map_or(1, |p| p.column),
                    field: e.path,
                    message: e.message,
                }
            })
            .collect()
    };
    let (mut snapshot, warnings) =
        compile::compile(raw, path).map_err(|errors| ConfigErrors(locate(errors)))?;
    if !warnings.is_empty() {
        snapshot.warnings = locate(warnings);
    }
    snapshot.source_info = SourceInfo::of(source);
    if let Some(file) = &snapshot.overrides_file {
        let (overrides, sha256) =
            overrides::load_file(file, &snapshot.routes, snapshot.rlqs.as_ref())
                .map_err(ConfigErrors)?;
        snapshot.overrides = overrides;
        snapshot.overrides_sha256 = Some(sha256);
    }
    Ok(snapshot)
}

/// Removes every ` at line N column M` from a parser message.
fn strip_positions(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find(" at line ") {
        out.push_str(&rest[..i]);
        let after = &rest[i + " at line ".len()..];
        let digits = |s: &str| s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let line_len = digits(after);
        let tail = &after[line_len..];
        rest = match tail.strip_prefix(" column ") {
            Some(col) if line_len > 0 => &col[digits(col)..],
            _ => {
                out.push_str(" at line ");
                after
            }
        };
    }
    out.push_str(rest);
    out
}

/// serde_norway says `field.path: message at line L column C`; we say it in our own format.
fn serde_error(e: &serde_norway::Error, path: &Path) -> ConfigError {
    let text = e.to_string();
    // The position is ours to print; serde_norway may also repeat positions inside the message.
    let text = strip_positions(&text);
    let text = text.as_str();
    let (field, message) = match text.split_once(": ") {
        Some((field, message)) if !field.contains(' ') => (field.to_string(), message.to_string()),
        _ => (String::new(), text.to_string()),
    };
    let (line, column) = e.location().map_or((1, 1), |l| (l.line(), l.column()));
    ConfigError {
        file: path.to_path_buf(),
        line,
        column,
        field,
        message,
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod targets_tests;
