//! Finding the repository's files and the external tools the tests run.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Finds `name` on PATH.
pub fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// Where the repository's files are, whatever the test's working directory.
pub fn repo_path(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(relative)
}

/// Runs a command from the repository's root that must succeed, and returns its stdout. Panics
/// with an install hint when the program is absent: CI must have it.
pub fn run_ok(program: &str, args: &[&str], install: &str) -> String {
    let binary = which(program)
        .unwrap_or_else(|| panic!("`{program}` is not on PATH: install it ({install})"));
    let output = Command::new(binary)
        .args(args)
        .current_dir(repo_path(""))
        .output()
        .unwrap_or_else(|e| panic!("run {program}: {e}"));
    assert!(
        output.status.success(),
        "{program} {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}
