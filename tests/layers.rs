//! The layers check: no import cycle between top-level modules of `src/`.
//!
//! Run it with `cargo test --test layers` (add `-- --nocapture` to print the graph). It reads every
//! file under `src/`, maps each to its top-level module (`src/config/compile/mod.rs` is `config`,
//! `src/keys_tests.rs` is `keys` through its `#[path]`; `lib.rs` and `main.rs` are left out),
//! collects the `crate::X` paths each one names (grouped `use crate::{a, b::c}` included; `super::`
//! stays inside its module), and builds the graph between top-level modules. Test code
//! (`tests.rs`, `*_tests.rs`, inline `#[cfg(test)] mod … { … }`) and comments are not read: a test
//! may reach anything. Every strongly connected component with more than one module is a cycle,
//! and the check fails on any. Cycles inside one module's files are allowed.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

fn main_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level modules declared in `src/lib.rs`.
fn top_modules(lib: &str) -> BTreeSet<String> {
    lib.lines()
        .filter_map(|l| {
            let l = l.trim();
            let l = l.strip_prefix("pub ").unwrap_or(l);
            l.strip_prefix("mod ")?
                .strip_suffix(';')
                .map(str::to_string)
        })
        .collect()
}

/// The file's source with comments and inline `#[cfg(test)] mod … { … }` blocks removed.
fn code(text: &str) -> String {
    let mut out = String::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        if line.trim() == "#[cfg(test)]" {
            // Skip further attributes, then an inline test module to its closing brace.
            while lines
                .peek()
                .is_some_and(|l| l.trim_start().starts_with("#["))
            {
                lines.next();
            }
            let Some(next) = lines.peek() else { break };
            let t = next.trim_start();
            if (t.starts_with("mod ") || t.starts_with("pub(crate) mod ")) && t.ends_with('{') {
                let mut depth = 0i64;
                for l in lines.by_ref() {
                    depth += l.matches('{').count() as i64 - l.matches('}').count() as i64;
                    if depth <= 0 {
                        break;
                    }
                }
            }
            continue;
        }
        let line = match line.find("//") {
            Some(i) => &line[..i],
            None => line,
        };
        out.push_str(line);
        out.push('\n');
    }
    out
}

fn ident(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// The first segment after every `crate::` in `code`, grouped imports expanded.
fn crate_paths(code: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        let before = rest[..i].chars().next_back();
        let after = &rest[i + "crate::".len()..];
        rest = after;
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$') {
            continue;
        }
        let after = after.trim_start();
        if let Some(group) = after.strip_prefix('{') {
            // Top-level items of the group: split on commas at depth 0.
            let mut depth = 0;
            let mut start = 0;
            let bytes = group.as_bytes();
            let mut items = Vec::new();
            for (j, &b) in bytes.iter().enumerate() {
                match b {
                    b'{' => depth += 1,
                    b'}' if depth == 0 => {
                        items.push(&group[start..j]);
                        break;
                    }
                    b'}' => depth -= 1,
                    b',' if depth == 0 => {
                        items.push(&group[start..j]);
                        start = j + 1;
                    }
                    _ => {}
                }
            }
            for item in items {
                found.insert(ident(item.trim_start()).to_string());
            }
        } else {
            found.insert(ident(after).to_string());
        }
    }
    found
}

/// Strongly connected components (Tarjan), each sorted.
fn components(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct T<'a> {
        g: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a str) {
        let i = t.index.len();
        t.index.insert(v, i);
        t.low.insert(v, i);
        t.stack.push(v);
        t.on.insert(v);
        for w in &t.g[v] {
            let w = w.as_str();
            if !t.index.contains_key(w) {
                visit(t, w);
                let lw = t.low[w];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if t.on.contains(w) {
                let iw = t.index[w];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if t.low[v] == t.index[v] {
            let mut c = Vec::new();
            loop {
                let w = t.stack.pop().unwrap();
                t.on.remove(w);
                c.push(w.to_string());
                if w == v {
                    break;
                }
            }
            c.sort();
            t.out.push(c);
        }
    }
    let mut t = T {
        g: graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !t.index.contains_key(v.as_str()) {
            visit(&mut t, v);
        }
    }
    t.out.sort();
    t.out
}

/// The module a file belongs to, or `None` for `lib.rs`, `main.rs` and test files.
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).unwrap();
    let name = rel.file_name()?.to_str()?;
    if name == "tests.rs" || name.ends_with("_tests.rs") {
        return None;
    }
    let first = rel.components().next()?.as_os_str().to_str()?;
    let module = first.strip_suffix(".rs").unwrap_or(first);
    (module != "lib" && module != "main").then(|| module.to_string())
}

#[test]
fn no_cycles_between_top_level_modules() {
    let src = main_dir();
    let modules = top_modules(&fs::read_to_string(src.join("lib.rs")).unwrap());
    let mut all = Vec::new();
    files(&src, &mut all);
    let mut graph: BTreeMap<String, BTreeSet<String>> = modules
        .iter()
        .map(|m| (m.clone(), BTreeSet::new()))
        .collect();
    for file in &all {
        let Some(module) = module_of(&src, file) else {
            continue;
        };
        assert!(
            modules.contains(&module),
            "{} is in no module of lib.rs",
            file.display()
        );
        let text = fs::read_to_string(file).unwrap();
        for target in crate_paths(&code(&text)) {
            if target != module && modules.contains(&target) {
                graph.get_mut(&module).unwrap().insert(target);
            }
        }
    }
    let mut report = String::from("module graph (module -> modules it names):\n");
    for (m, deps) in &graph {
        let deps: Vec<_> = deps.iter().map(String::as_str).collect();
        report += &format!("  {m} -> {}\n", deps.join(", "));
    }
    let cycles: Vec<_> = components(&graph)
        .into_iter()
        .filter(|c| c.len() > 1)
        .collect();
    report += "cycles (strongly connected components):\n";
    for c in &cycles {
        report += &format!("  {}\n", c.join(", "));
    }
    if cycles.is_empty() {
        report += "  none\n";
    }
    println!("{report}");
    assert!(
        cycles.is_empty(),
        "import cycles between top-level modules: {cycles:?}\n{report}"
    );
}
