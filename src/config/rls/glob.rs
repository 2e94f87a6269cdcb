//! Wildcard descriptor values: `*` matches any run of characters, anywhere in the value.
//!
//! envoyproxy/ratelimit started with a trailing `*` only (a prefix match) and later allowed `*`
//! anywhere (`/api*v1`, `svc*ep*rpc`); both are this one matcher.

/// A compiled wildcard value. Literal parts are kept in order, so matching is a prefix check, a
/// suffix check and an in-order search for the middle parts, without allocating.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Glob {
    /// The value as written in the config, `*` included.
    pattern: Box<str>,
    prefix: Box<str>,
    middle: Box<[Box<str>]>,
    suffix: Box<str>,
}

impl Glob {
    /// Compiles `pattern` when it holds at least one `*`; a value without one is matched exactly
    /// and needs no glob.
    pub fn new(pattern: &str) -> Option<Glob> {
        let mut parts: Vec<&str> = pattern.split('*').collect();
        if parts.len() < 2 {
            return None;
        }
        let suffix = parts.pop().unwrap_or_default();
        let prefix = if parts.is_empty() {
            ""
        } else {
            parts.remove(0)
        };
        Some(Glob {
            pattern: pattern.into(),
            prefix: prefix.into(),
            middle: parts
                .into_iter()
                .filter(|p| !p.is_empty())
                .map(Into::into)
                .collect(),
            suffix: suffix.into(),
        })
    }

    /// The pattern as written, which also names the shared counter of a `share_threshold` value.
    pub fn pattern(&self) -> &str {
        &self.pattern
    }

    /// Whether `value` matches. Greedy leftmost search of the middle parts is exact for `*`-only
    /// globs: taking the earliest occurrence never prevents a later part from matching.
    pub fn matches(&self, value: &str) -> bool {
        if value.len() < self.prefix.len() + self.suffix.len() {
            return false;
        }
        if !value.starts_with(&*self.prefix) || !value.ends_with(&*self.suffix) {
            return false;
        }
        let mut rest = &value[self.prefix.len()..value.len() - self.suffix.len()];
        for part in self.middle.iter() {
            match rest.find(&**part) {
                Some(at) => rest = &rest[at + part.len()..],
                None => return false,
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::Glob;

    fn m(pattern: &str, value: &str) -> bool {
        Glob::new(pattern).unwrap().matches(value)
    }

    #[test]
    fn plain_values_are_not_globs() {
        assert!(Glob::new("foo").is_none());
        assert!(Glob::new("").is_none());
    }

    #[test]
    fn trailing_star_is_a_prefix_match() {
        assert!(m("foo*", "foo"));
        assert!(m("foo*", "foobar"));
        assert!(!m("foo*", "fo"));
        assert!(!m("foo*", "xfoo"));
    }

    #[test]
    fn star_anywhere() {
        assert!(m("bar*b", "barb"));
        assert!(m("bar*b", "barxyzb"));
        assert!(!m("bar*b", "barxyz"));
        assert!(m("*b", "b"));
        assert!(m("*", ""));
        assert!(m("*", "anything"));
        assert!(m("foo*bar*baz", "foobarbaz"));
        assert!(m("foo*bar*baz", "foo1bar2baz"));
        assert!(!m("foo*bar*baz", "foo1baz2bar"));
        assert!(m("svc*ep*rpc", "svc-a/ep-b/rpc"));
        assert!(!m("svc*ep*rpc", "svc-a/rpc"));
        assert!(m("/api*v1", "/api/users/v1"));
        assert!(!m("/api*v1", "/api/users/v2"));
    }

    #[test]
    fn prefix_and_suffix_must_not_overlap() {
        assert!(!m("ab*ba", "aba"));
        assert!(m("ab*ba", "abba"));
        assert!(m("a**b", "ab"));
    }
}
