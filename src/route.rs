//! Which route a request belongs to. Patterns are compiled once at config load into segments, and
//! matching is a pure function of the request head: no allocation, path parameters are returned as
//! byte ranges into the request's own path.
//!
//! The head is the canonical request ([`crate::normalize`]): its path is normalised and its host
//! is lower-case, so a prefix cannot be escaped with `..` and a host cannot be re-spelt. A `path`
//! pattern matches with or without one trailing slash, with the same parameters.

use http::{HeaderMap, HeaderName, HeaderValue, Method};

/// The most `{param}`s one path pattern may have.
pub const MAX_PARAMS: usize = 8;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(Box<str>),
    Param,
    CatchAll,
}

/// How a route selects requests. All given conditions must hold.
#[derive(Debug, Clone, Default)]
pub struct RouteMatch {
    path: PathMatch,
    methods: Option<Vec<Method>>,
    /// Lowercase, without port.
    host: Option<Box<str>>,
    headers: Vec<(HeaderName, HeaderValue)>,
    /// The pattern's parameter names, in order (for the status page; never read when matching).
    names: Vec<Box<str>>,
}

#[derive(Debug, Clone, Default)]
enum PathMatch {
    #[default]
    Any,
    Prefix(Box<str>),
    Pattern(Vec<Segment>),
}

/// The path parameters of a matched request, as byte ranges into its path.
#[derive(Debug, Clone, Copy, Default)]
pub struct PathParams {
    ranges: [(u32, u32); MAX_PARAMS],
    len: u8,
}

impl PathParams {
    fn push(&mut self, start: usize, end: usize) {
        if (self.len as usize) < MAX_PARAMS {
            self.ranges[self.len as usize] = (start as u32, end as u32);
            self.len += 1;
        }
    }

    /// The value of the `index`-th parameter of the pattern, sliced from `path`.
    pub fn get<'p>(&self, path: &'p str, index: usize) -> Option<&'p str> {
        if index >= self.len as usize {
            return None;
        }
        let (start, end) = self.ranges[index];
        path.get(start as usize..end as usize)
    }
}

/// The parts of a request head that routing looks at.
#[derive(Debug, Clone, Copy)]
pub struct RequestHead<'a> {
    pub method: &'a Method,
    pub host: Option<&'a str>,
    pub path: &'a str,
    pub headers: &'a HeaderMap,
}

impl RouteMatch {
    /// The match as the config writes it, for people (the status page): `path /users/{id}`,
    /// `prefix /api/` or `any path`, then `methods`, `host` and `headers` when given.
    pub fn describe(&self) -> String {
        let mut out = match &self.path {
            PathMatch::Any => "any path".to_string(),
            PathMatch::Prefix(prefix) => format!("prefix {prefix}"),
            PathMatch::Pattern(segments) => {
                let mut names = self.names.iter();
                let mut text = String::from("path ");
                for segment in segments {
                    text.push('/');
                    match segment {
                        Segment::Literal(s) => text.push_str(s),
                        Segment::Param => {
                            let name = names.next().map_or("", |n| n);
                            text.push_str(&format!("{{{name}}}"));
                        }
                        Segment::CatchAll => {
                            let name = names.next().map_or("", |n| n);
                            text.push_str(&format!("{{*{name}}}"));
                        }
                    }
                }
                text
            }
        };
        if let Some(methods) = &self.methods {
            let list: Vec<&str> = methods.iter().map(Method::as_str).collect();
            out.push_str(&format!(", methods {}", list.join(" ")));
        }
        if let Some(host) = &self.host {
            out.push_str(&format!(", host {host}"));
        }
        for (name, value) in &self.headers {
            out.push_str(&format!(", {name}: {}", value.to_str().unwrap_or("…")));
        }
        out
    }

    /// The pattern's parameter names, in order (what `path:PARAM` key parts index).
    pub fn param_names(&self) -> impl Iterator<Item = &str> {
        self.names.iter().map(|n| &**n)
    }

    /// The names of the request fields this match compares.
    pub fn header_names(&self) -> impl Iterator<Item = &HeaderName> {
        self.headers.iter().map(|(name, _)| name)
    }

    /// Compiles a `path` pattern (`/users/{id}`, `/files/{*rest}`). Returns the parameter names
    /// in order, for key parts to refer to by index.
    pub fn with_pattern(pattern: &str) -> Result<(Self, Vec<String>), String> {
        let Some(body) = pattern.strip_prefix('/') else {
            return Err(format!("`{pattern}` must start with `/`"));
        };
        // `/a/` and `/a` are one pattern: requests are matched without their trailing slash.
        let body = body.strip_suffix('/').unwrap_or(body);
        let mut segments = Vec::new();
        let mut names: Vec<String> = Vec::new();
        let parts: Vec<&str> = body.split('/').collect();
        for (i, part) in parts.iter().enumerate() {
            let segment = if let Some(inner) =
                part.strip_prefix('{').and_then(|p| p.strip_suffix('}'))
            {
                let (name, segment) = match inner.strip_prefix('*') {
                    Some(name) if i + 1 == parts.len() => (name, Segment::CatchAll),
                    Some(_) => {
                        return Err(format!("`{pattern}`: `{{*name}}` must be the last segment"))
                    }
                    None => (inner, Segment::Param),
                };
                if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                    return Err(format!(
                        "`{pattern}`: parameter names are letters, digits and `_`"
                    ));
                }
                if names.iter().any(|n| n == name) {
                    return Err(format!("`{pattern}`: parameter `{name}` appears twice"));
                }
                names.push(name.to_string());
                segment
            } else if part.contains(['{', '}']) {
                return Err(format!(
                    "`{pattern}`: a segment is either literal or one whole `{{name}}`"
                ));
            } else {
                Segment::Literal((*part).into())
            };
            segments.push(segment);
        }
        if names.len() > MAX_PARAMS {
            return Err(format!("`{pattern}` has more than {MAX_PARAMS} parameters"));
        }
        let matcher = RouteMatch {
            path: PathMatch::Pattern(segments),
            names: names.iter().map(|n| n.as_str().into()).collect(),
            ..RouteMatch::default()
        };
        Ok((matcher, names))
    }

    pub fn with_prefix(prefix: &str) -> Result<Self, String> {
        if !prefix.starts_with('/') {
            return Err(format!("`{prefix}` must start with `/`"));
        }
        Ok(RouteMatch {
            path: PathMatch::Prefix(prefix.into()),
            ..RouteMatch::default()
        })
    }

    pub fn set_methods(&mut self, methods: Vec<Method>) {
        self.methods = Some(methods);
    }

    /// The host as requests spell it canonically: lower-case, without a trailing dot.
    pub fn set_host(&mut self, host: &str) {
        let host = host.strip_suffix('.').unwrap_or(host);
        self.host = Some(host.to_ascii_lowercase().into());
    }

    pub fn add_header(&mut self, name: HeaderName, value: HeaderValue) {
        self.headers.push((name, value));
    }

    /// The path parameters when `head` matches, `None` otherwise.
    pub fn matches(&self, head: &RequestHead<'_>) -> Option<PathParams> {
        if !self.method_allowed(head.method) {
            return None;
        }
        self.matches_except_method(head)
    }

    /// The methods this route is limited to (`None`: every method).
    pub fn methods(&self) -> Option<&[Method]> {
        self.methods.as_deref()
    }

    fn method_allowed(&self, method: &Method) -> bool {
        self.methods.as_ref().is_none_or(|m| m.contains(method))
    }

    /// Whether `head` matches every condition but the method: a 405 rather than a 404 when no
    /// route takes its method (RFC 9110 §15.5.6).
    pub fn matches_except_method(&self, head: &RequestHead<'_>) -> Option<PathParams> {
        let limit = match &self.path {
            PathMatch::Pattern(segments) => segments.len(),
            _ => 0,
        };
        self.matches_split(head, &SplitPath::new(head.path, limit))
    }

    /// [`Self::matches_except_method`] on a path already split: the path first (the cheapest
    /// test that most often fails), then host and headers. Costs the route's size, never the
    /// path's length.
    fn matches_split(&self, head: &RequestHead<'_>, path: &SplitPath<'_>) -> Option<PathParams> {
        let mut params = PathParams::default();
        let ok = match &self.path {
            PathMatch::Any => true,
            PathMatch::Prefix(prefix) => path.raw.starts_with(&**prefix),
            PathMatch::Pattern(segments) => match_segments(segments, path, &mut params),
        };
        if !ok {
            return None;
        }
        if let Some(want) = &self.host {
            let host = head.host?;
            let host = host.rsplit_once(':').map_or(host, |(h, port)| {
                if port.bytes().all(|b| b.is_ascii_digit()) {
                    h
                } else {
                    host
                }
            });
            if !host.eq_ignore_ascii_case(want) {
                return None;
            }
        }
        for (name, value) in &self.headers {
            if !head.headers.get_all(name).iter().any(|v| v == value) {
                return None;
            }
        }
        Some(params)
    }

    /// The literal first path segment every request this route matches has (`api` for
    /// `/api/users/{id}` or prefix `/api/`), or `None` when it can match more than one.
    fn first_literal(&self) -> Option<&str> {
        match &self.path {
            PathMatch::Pattern(segments) => match segments.first() {
                Some(Segment::Literal(literal)) => Some(literal),
                _ => None,
            },
            // `/api/...` fixes the first segment; `/api` also matches `/apis`.
            PathMatch::Prefix(prefix) => prefix[1..].split_once('/').map(|(first, _)| first),
            PathMatch::Any => None,
        }
    }
}

impl AsRef<RouteMatch> for RouteMatch {
    fn as_ref(&self) -> &RouteMatch {
        self
    }
}

/// A request path split into segments once, for every route to test without scanning the path
/// again. Only the first `limit + 2` slashes are found (`limit`: the most segments any pattern
/// has), so a path with more segments than any pattern costs no more than one that has as many.
#[derive(Debug)]
struct SplitPath<'p> {
    /// As requested: what a prefix is tested against.
    raw: &'p str,
    /// Without one trailing slash (`/` stays `/`): what a pattern is tested against.
    trimmed: &'p str,
    /// Byte offsets in `trimmed` of its first slashes, the leading one included.
    slashes: smallvec::SmallVec<[usize; 16]>,
    /// Whether `slashes` holds every slash of `trimmed`.
    complete: bool,
}

impl<'p> SplitPath<'p> {
    fn new(raw: &'p str, limit: usize) -> Self {
        let trimmed = match raw.strip_suffix('/') {
            Some(trimmed) if !trimmed.is_empty() => trimmed,
            _ => raw,
        };
        let mut slashes = smallvec::SmallVec::new();
        let mut complete = true;
        if trimmed.starts_with('/') {
            // `match_indices` of a `char` searches with memchr.
            for (i, _) in trimmed.match_indices('/') {
                if slashes.len() == limit + 2 {
                    complete = false;
                    break;
                }
                slashes.push(i);
            }
        }
        SplitPath {
            raw,
            trimmed,
            slashes,
            complete,
        }
    }

    /// The path's first segment (`api` in `/api/users`), `None` when it does not start with `/`.
    fn first(&self) -> Option<&'p str> {
        let start = self.slashes.first()? + 1;
        let end = self.slashes.get(1).copied().unwrap_or(self.trimmed.len());
        // A path with one slash has been scanned whole: its end is the first segment's.
        self.trimmed.get(start..end)
    }

    /// The byte range in `trimmed` of segment `index`, `None` when the path has fewer segments.
    fn segment(&self, index: usize) -> Option<(usize, usize)> {
        let start = self.slashes.get(index)? + 1;
        let end = match self.slashes.get(index + 1) {
            Some(&slash) => slash,
            None if self.complete => self.trimmed.len(),
            // Past what was scanned (a pattern longer than the table's `limit`: not built so).
            None => self.trimmed[start..]
                .find('/')
                .map_or(self.trimmed.len(), |i| start + i),
        };
        Some((start, end))
    }
}

fn match_segments(segments: &[Segment], path: &SplitPath<'_>, params: &mut PathParams) -> bool {
    // Not a path (`*`): no pattern matches it.
    if path.slashes.is_empty() {
        return false;
    }
    for (i, segment) in segments.iter().enumerate() {
        if *segment == Segment::CatchAll {
            // The rest after the segments matched so far; empty when nothing follows them.
            let len = path.trimmed.len();
            let start = path.segment(i).map_or(len, |(start, _)| start);
            params.push(start, len);
            return true;
        }
        let Some((start, end)) = path.segment(i) else {
            return false;
        };
        match segment {
            Segment::Literal(literal) if **literal == path.trimmed[start..end] => {}
            Segment::Param if start < end => params.push(start, end),
            _ => return false,
        }
    }
    // Every segment of the pattern matched: the path must have no more.
    path.segment(segments.len()).is_none()
}

/// The routes of a config, indexed by the literal first path segment they require, so that a
/// request is tested only against the routes that could match it, in config order (the first
/// match wins). Splitting the path is done once per request and costs its length; each route
/// tested costs its own size. A path whose first segment is longer than any route's literal one
/// is looked up in no index at all.
#[derive(Debug, Default)]
pub struct RouteTable {
    /// Route indices (ascending) by the first segment they require.
    by_first: hashbrown::HashMap<Box<str>, Box<[u32]>>,
    /// Route indices (ascending) that any first segment may match.
    any_first: Box<[u32]>,
    /// The longest key of `by_first`.
    longest_first: usize,
    /// The most segments of any pattern.
    max_segments: usize,
}

/// How a request was routed.
#[derive(Debug, Clone, Copy)]
pub enum Found {
    /// The first route matching it, by index, with its path parameters.
    Route(usize, PathParams),
    /// No route matches, but some match all of it except the method (405): the first of them
    /// starts at this position in the request's candidate list.
    OtherMethods(usize),
    /// No route matches (404).
    Nothing,
}

impl RouteTable {
    /// Indexes `matchers`, given in config order.
    pub fn new<'m>(matchers: impl IntoIterator<Item = &'m RouteMatch>) -> Self {
        let mut by_first: hashbrown::HashMap<Box<str>, Vec<u32>> = hashbrown::HashMap::new();
        let mut any_first = Vec::new();
        let mut max_segments = 0;
        for (i, m) in matchers.into_iter().enumerate() {
            let i = u32::try_from(i).unwrap_or(u32::MAX);
            if let PathMatch::Pattern(segments) = &m.path {
                max_segments = max_segments.max(segments.len());
            }
            match m.first_literal() {
                Some(first) => by_first.entry(first.into()).or_default().push(i),
                None => any_first.push(i),
            }
        }
        RouteTable {
            longest_first: by_first.keys().map(|k| k.len()).max().unwrap_or(0),
            by_first: by_first
                .into_iter()
                .map(|(k, v)| (k, v.into_boxed_slice()))
                .collect(),
            any_first: any_first.into_boxed_slice(),
            max_segments,
        }
    }

    /// The routes `path` could match, in config order.
    fn candidates<'t>(&'t self, path: &SplitPath<'_>) -> Candidates<'t> {
        let indexed = path
            .first()
            .filter(|first| first.len() <= self.longest_first)
            .and_then(|first| self.by_first.get(first))
            .map_or(&[][..], |v| &v[..]);
        Candidates {
            indexed,
            any: &self.any_first,
        }
    }

    /// Routes `head` in one pass: the first of `matchers` (the table's, in the same order) that
    /// matches it, else whether some match it but for the method.
    pub fn find(&self, matchers: &[impl AsRef<RouteMatch>], head: &RequestHead<'_>) -> Found {
        self.find_counting(matchers, head).0
    }

    /// [`Self::find`], and how many routes it tested: what a request costs beyond splitting
    /// its path once (for tests that bound it).
    pub fn find_counting(
        &self,
        matchers: &[impl AsRef<RouteMatch>],
        head: &RequestHead<'_>,
    ) -> (Found, usize) {
        let path = SplitPath::new(head.path, self.max_segments);
        let mut other_methods = None;
        let mut tested = 0;
        for (position, i) in self.candidates(&path).enumerate() {
            let Some(m) = matchers.get(i) else { continue };
            let m = m.as_ref();
            tested += 1;
            let Some(params) = m.matches_split(head, &path) else {
                continue;
            };
            if m.method_allowed(head.method) {
                return (Found::Route(i, params), tested);
            }
            other_methods.get_or_insert(position);
        }
        let found = other_methods.map_or(Found::Nothing, Found::OtherMethods);
        (found, tested)
    }

    /// After [`Found::OtherMethods`]: the `Allow` methods, in config order, each once (RFC 9110
    /// §10.2.1), of the routes that match `head` but for its method.
    pub fn allowed_methods<'m>(
        &self,
        matchers: &'m [impl AsRef<RouteMatch>],
        head: &RequestHead<'_>,
        from: usize,
    ) -> Vec<&'m Method> {
        let path = SplitPath::new(head.path, self.max_segments);
        let mut allow: Vec<&Method> = Vec::new();
        for i in self.candidates(&path).skip(from) {
            let Some(m) = matchers.get(i) else { continue };
            let m = m.as_ref();
            if m.matches_split(head, &path).is_none() {
                continue;
            }
            for method in m.methods().unwrap_or_default() {
                if !allow.contains(&method) {
                    allow.push(method);
                }
            }
        }
        allow
    }
}

/// Two ascending lists of route indices merged in ascending order.
struct Candidates<'t> {
    indexed: &'t [u32],
    any: &'t [u32],
}

impl Iterator for Candidates<'_> {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        let next = match (self.indexed.first(), self.any.first()) {
            (Some(&a), Some(&b)) if a < b => {
                self.indexed = &self.indexed[1..];
                a
            }
            (_, Some(&b)) => {
                self.any = &self.any[1..];
                b
            }
            (Some(&a), None) => {
                self.indexed = &self.indexed[1..];
                a
            }
            (None, None) => return None,
        };
        Some(next as usize)
    }
}

#[cfg(test)]
#[path = "route_tests.rs"]
mod tests;
