//! envoyproxy/ratelimit's own config fixtures (`tests/fixtures/envoy-ratelimit-config/`) load, or fail
//! with its messages, exactly as that directory's README table says. Every fixture file must be
//! covered here, so a new fixture cannot be skipped silently.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use turnstile::rls::{LoadOptions, RlsConfig, RlsConfigError};

/// envoyproxy/ratelimit's fixtures, kept in the repository (`tests/fixtures/envoy-ratelimit-config`,
/// with upstream's LICENSE and where they come from): a fresh clone has all its tests need.
fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/envoy-ratelimit-config")
}

fn test_config(name: &str) -> PathBuf {
    fixtures().join("test-config").join(name)
}

fn load(names: &[&str], merge_domains: bool) -> Result<RlsConfig, RlsConfigError> {
    let paths: Vec<PathBuf> = names.iter().map(|n| test_config(n)).collect();
    RlsConfig::load_files(&paths, LoadOptions { merge_domains })
}

/// Asserts that loading `names` fails in `file` at `line` with `message` (as a substring of the
/// whole error, which is `file:line: message (field ...)`).
fn fails(names: &[&str], merge: bool, file: &str, line: usize, field: Option<&str>, message: &str) {
    let err = match load(names, merge) {
        Ok(_) => panic!("{names:?} loaded, expected: {message}"),
        Err(e) => e,
    };
    let text = err.to_string();
    assert!(
        text.contains(message),
        "{names:?}: got {text:?}, expected {message:?}"
    );
    match err {
        RlsConfigError::Invalid {
            file: f,
            line: l,
            field: fd,
            ..
        } => {
            assert!(f.ends_with(file), "{text}: wrong file");
            assert_eq!(l, line, "{text}: wrong line");
            assert_eq!(fd.as_deref(), field, "{text}: wrong field");
            assert!(text.starts_with(&format!("{f}:{line}: ")), "{text}");
        }
        other => panic!("{names:?}: not an Invalid error: {other:?}"),
    }
}

/// Files loaded together, then the file, line, field and message of the expected error.
type Expected<'a> = (&'a [&'a str], &'a str, usize, Option<&'a str>, &'a str);

#[test]
fn every_fixture_loads_or_fails_as_the_readme_table_says() {
    let mut covered = BTreeSet::new();
    let mut cover = |names: &[&str]| covered.extend(names.iter().map(|n| n.to_string()));

    for ok in [
        "basic_config.yaml",
        "shadowmode_config.yaml",
        "wildcard.yaml",
        "share_threshold.yaml",
        "metadata.yaml",
    ] {
        let config = load(&[ok], false).unwrap_or_else(|e| panic!("{ok}: {e}"));
        assert!(config.has_domain("test-domain"), "{ok}");
        assert!(!config.rules().is_empty(), "{ok}");
        cover(&[ok]);
    }

    let merge = ["merge_domain_key1.yaml", "merge_domain_key2.yaml"];
    let merged = load(&merge, true).expect("merged domains load");
    assert!(merged
        .lookup("test-domain", &[("key1", "value1")])
        .is_some());
    assert!(merged
        .lookup("test-domain", &[("key2", "value2")])
        .is_some());
    fails(
        &merge,
        false,
        "merge_domain_key2.yaml",
        2,
        Some("domain"),
        "duplicate domain 'test-domain' in config file",
    );
    fails(
        &["merge_domain_key1.yaml", "merge_domain_key1.yaml"],
        true,
        "merge_domain_key1.yaml",
        5,
        Some("descriptors[0]"),
        "duplicate descriptor composite key 'test-domain.key1_value1'",
    );
    cover(&merge);

    let table: &[Expected] = &[
        (
            &["empty_domain.yaml"],
            "empty_domain.yaml",
            1,
            Some("domain"),
            "config file cannot have empty domain",
        ),
        (
            &["basic_config.yaml", "duplicate_domain.yaml"],
            "duplicate_domain.yaml",
            1,
            Some("domain"),
            "duplicate domain 'test-domain' in config file",
        ),
        (
            &["empty_key.yaml"],
            "empty_key.yaml",
            3,
            Some("descriptors[0].key"),
            "descriptor has empty key",
        ),
        (
            &["duplicate_key.yaml"],
            "duplicate_key.yaml",
            6,
            Some("descriptors[1]"),
            "duplicate descriptor composite key 'test-domain.key1_value1'",
        ),
        (
            &["bad_limit_unit.yaml"],
            "bad_limit_unit.yaml",
            6,
            Some("descriptors[0].rate_limit.unit"),
            "invalid rate limit unit 'foo'",
        ),
        (
            &["replaces_self.yaml"],
            "replaces_self.yaml",
            10,
            Some("descriptors[0].descriptors[0].rate_limit.replaces[0]"),
            "replaces should not contain name of same descriptor",
        ),
        (
            &["replaces_empty.yaml"],
            "replaces_empty.yaml",
            10,
            Some("descriptors[0].descriptors[0].rate_limit.replaces[0]"),
            "should not have an empty replaces entry",
        ),
        (
            &["bad_yaml.yaml"],
            "bad_yaml.yaml",
            1,
            None,
            "error loading config file: ",
        ),
        (
            &["misspelled_key.yaml"],
            "misspelled_key.yaml",
            5,
            Some("descriptors[0].ratelimit"),
            "config error, unknown key 'ratelimit'",
        ),
        (
            &["misspelled_key2.yaml"],
            "misspelled_key2.yaml",
            7,
            Some("descriptors[0].rate_limit.requestsperunit"),
            "config error, unknown key 'requestsperunit'",
        ),
        (
            &["non_string_key.yaml"],
            "non_string_key.yaml",
            1,
            None,
            "config error, key is not of type string: 0.25",
        ),
        (
            &["non_map_list.yaml"],
            "non_map_list.yaml",
            3,
            Some("descriptors"),
            "config error, yaml file contains list of type other than map: a",
        ),
        (
            &["unlimited_with_unit.yaml"],
            "unlimited_with_unit.yaml",
            6,
            Some("descriptors[0].rate_limit.unit"),
            "should not specify rate limit unit when unlimited",
        ),
    ];
    for (names, file, line, field, message) in table {
        fails(names, false, file, *line, *field, message);
        cover(names);
    }

    let on_disk: BTreeSet<String> = std::fs::read_dir(fixtures().join("test-config"))
        .expect("test-config is readable")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        covered, on_disk,
        "every fixture, and only fixtures, are covered"
    );
}

#[test]
fn the_integration_directory_loads_as_one_config() {
    let config = RlsConfig::load(&fixtures().join("integration"), LoadOptions::default())
        .expect("integration configs load");
    let mut domains: Vec<&str> = config.domains().collect();
    domains.sort_unstable();
    assert_eq!(domains, ["another", "basic", "share-threshold-test"]);
    let (_, rule) = config
        .lookup("basic", &[("one_per_minute", "x")])
        .expect("one_per_minute has a limit");
    assert_eq!(rule.requests_per_unit, 1);
}

#[test]
fn a_directory_without_yaml_files_is_an_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("notes.txt"), "domain: x\n").expect("write");
    let err = RlsConfig::load(dir.path(), LoadOptions::default()).unwrap_err();
    assert!(matches!(err, RlsConfigError::NoFiles { .. }), "{err}");
}

#[test]
fn a_missing_path_names_the_path() {
    let err =
        RlsConfig::load(Path::new("/nonexistent/rls.yaml"), LoadOptions::default()).unwrap_err();
    assert!(
        err.to_string().starts_with("/nonexistent/rls.yaml: "),
        "{err}"
    );
}

/// `unit_multiplier` (issue 15): N units make the window; without it a file keeps
/// envoyproxy/ratelimit's meaning; 0, a negative number or a window past a century is an error
/// at the field's line.
#[test]
fn unit_multiplier_scales_the_window_and_bad_values_name_file_and_line() {
    use std::time::Duration;
    use turnstile::rls::Algorithm;
    let dir = tempfile::tempdir().expect("tempdir");
    let load_text = |text: &str| {
        let path = dir.path().join("m.yaml");
        std::fs::write(&path, text).expect("write");
        RlsConfig::load(&path, LoadOptions::default())
    };
    let config = load_text(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 5, unit_multiplier: 30}\n  - key: b\n    rate_limit: {unit: minute, requests_per_unit: 5}\n",
    )
    .expect("loads");
    let (_, a) = config.lookup("d", &[("a", "x")]).expect("a");
    assert_eq!(
        a.algorithm,
        Algorithm::SlidingWindow {
            limit: 5,
            window: Duration::from_secs(30)
        }
    );
    let (_, b) = config.lookup("d", &[("b", "x")]).expect("b");
    assert_eq!(
        b.algorithm,
        Algorithm::SlidingWindow {
            limit: 5,
            window: Duration::from_secs(60)
        }
    );
    for (value, message) in [
        ("0", "unit_multiplier must be at least 1"),
        ("-2", "-2 is not an unsigned 32-bit integer"),
        ("4000000000", "more than 100 years"),
    ] {
        let err = load_text(&format!(
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: day\n      requests_per_unit: 5\n      unit_multiplier: {value}\n"
        ))
        .expect_err(value);
        let text = err.to_string();
        assert!(text.contains("m.yaml:7: "), "{text}");
        assert!(text.contains(message), "{text}");
        assert!(text.contains("unit_multiplier"), "{text}");
    }
}

/// Regression (issue 34, item 7): the fixtures were read from `shared/` beside the checkout, so a
/// fresh clone failed here. They live in the repository, with their licence and origin.
#[test]
fn the_fixtures_ship_with_the_repository_and_their_licence() {
    let dir = fixtures();
    assert!(
        dir.starts_with(env!("CARGO_MANIFEST_DIR")),
        "{}",
        dir.display()
    );
    for file in [
        "LICENSE",
        "README.md",
        "test-config/basic_config.yaml",
        "integration/basic.yaml",
    ] {
        assert!(
            dir.join(file).is_file(),
            "{file} is missing from {}",
            dir.display()
        );
    }
    let licence = std::fs::read_to_string(dir.join("LICENSE")).expect("LICENSE");
    assert!(licence.contains("Apache License"), "the Apache-2.0 licence");
}
