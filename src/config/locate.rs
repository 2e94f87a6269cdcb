//! Where each field sits in the YAML source, so that validation errors found after parsing can
//! still say `FILE:LINE:COL`. serde does not keep spans; a second, event-level pass over the text
//! records the position of every node by its field path (`routes[0].policies[1].key`).

use std::collections::HashMap;

use yaml_rust2::parser::{Event, MarkedEventReceiver, Parser};
use yaml_rust2::scanner::Marker;

/// A 1-based line and column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Position {
    pub line: usize,
    pub column: usize,
}

/// Positions of every node of a document, by field path, and the problems serde cannot place.
#[derive(Debug, Default)]
pub struct Positions {
    by_path: HashMap<String, Position>,
    /// Keys given twice in one mapping, in document order.
    pub duplicates: Vec<Duplicate>,
    /// When the document is not YAML and a flow collection was left open: which one.
    pub unclosed: Option<Unclosed>,
}

/// A key given twice in one mapping. serde reports these at the mapping, not at the key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Duplicate {
    /// The field path of the key, e.g. `routes[0].upstream`.
    pub path: String,
    pub first: Position,
    pub again: Position,
}

/// A `{` or `[` that a YAML syntax error left open. The scanner fails wherever it gives up, often
/// at the end of the file; the bracket that was never closed is the useful place to point at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unclosed {
    /// The field path of the innermost unclosed flow collection.
    pub path: String,
    pub bracket: char,
    pub at: Position,
    /// Where the scanner stopped.
    pub stopped: Position,
    /// The scanner's own words.
    pub message: String,
}

impl Positions {
    /// Indexes `source`. A document the event parser rejects keeps the positions seen before the
    /// error.
    pub fn index(source: &str) -> Self {
        let mut walker = Walker::default();
        let mut parser = Parser::new_from_str(source);
        let unclosed = parser
            .load(&mut walker, false)
            .err()
            .and_then(|e| walker.unclosed(source, &e));
        Positions {
            by_path: walker.by_path,
            duplicates: walker.duplicates,
            unclosed,
        }
    }

    /// The position of `path`, or of its nearest ancestor that exists (a missing field is reported
    /// at the mapping that lacks it).
    pub fn find(&self, path: &str) -> Option<Position> {
        let mut path = path;
        loop {
            if let Some(pos) = self.by_path.get(path) {
                return Some(*pos);
            }
            let cut = path.rfind(['.', '['])?;
            path = &path[..cut];
        }
    }
}

enum Frame {
    Mapping {
        path: String,
        key: Option<String>,
        /// The keys seen so far, and where.
        seen: HashMap<String, Position>,
        start: Marker,
    },
    Sequence {
        path: String,
        index: usize,
        start: Marker,
    },
}

impl Frame {
    fn path(&self) -> &str {
        match self {
            Frame::Mapping { path, .. } | Frame::Sequence { path, .. } => path,
        }
    }

    fn start(&self) -> Marker {
        match self {
            Frame::Mapping { start, .. } | Frame::Sequence { start, .. } => *start,
        }
    }
}

fn position(mark: Marker) -> Position {
    Position {
        line: mark.line(),
        column: mark.col() + 1,
    }
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

#[derive(Default)]
struct Walker {
    stack: Vec<Frame>,
    by_path: HashMap<String, Position>,
    duplicates: Vec<Duplicate>,
}

impl Walker {
    /// The path of a node starting now, or `None` when the node is a mapping key.
    fn node_path(&mut self) -> Option<String> {
        match self.stack.last_mut() {
            None => Some(String::new()),
            Some(Frame::Mapping { key: None, .. }) => None,
            Some(Frame::Mapping { path, key, .. }) => {
                let key = key.take().unwrap_or_default();
                Some(join(path, &key))
            }
            Some(Frame::Sequence { path, index, .. }) => {
                let p = format!("{path}[{index}]");
                *index += 1;
                Some(p)
            }
        }
    }

    fn record(&mut self, path: &str, mark: Marker) {
        self.by_path
            .entry(path.to_string())
            .or_insert(position(mark));
    }

    /// A mapping key: remembered for the value that follows, and checked against the keys before.
    fn key(&mut self, value: String, mark: Marker) {
        let Some(Frame::Mapping {
            path, key, seen, ..
        }) = self.stack.last_mut()
        else {
            return;
        };
        let again = position(mark);
        if let Some(first) = seen.get(&value) {
            self.duplicates.push(Duplicate {
                path: join(path, &value),
                first: *first,
                again,
            });
        } else {
            seen.insert(value.clone(), again);
        }
        *key = Some(value);
    }

    /// The innermost `{` or `[` still open when the scanner failed, if any.
    fn unclosed(&self, source: &str, e: &yaml_rust2::ScanError) -> Option<Unclosed> {
        self.stack.iter().rev().find_map(|frame| {
            let bracket = source.chars().nth(frame.start().index())?;
            matches!(bracket, '{' | '[').then(|| Unclosed {
                path: frame.path().to_string(),
                bracket,
                at: position(frame.start()),
                stopped: position(*e.marker()),
                message: e.info().to_string(),
            })
        })
    }
}

impl MarkedEventReceiver for Walker {
    fn on_event(&mut self, event: Event, mark: Marker) {
        match event {
            Event::Scalar(value, ..) => match self.node_path() {
                Some(path) => self.record(&path, mark),
                None => self.key(value, mark),
            },
            Event::Alias(_) => {
                if let Some(path) = self.node_path() {
                    self.record(&path, mark);
                }
            }
            Event::MappingStart(..) | Event::SequenceStart(..) => {
                // A complex mapping key has no useful path; index it under a placeholder.
                let path = self.node_path().unwrap_or_else(|| "?".to_string());
                self.record(&path, mark);
                self.stack.push(match event {
                    Event::MappingStart(..) => Frame::Mapping {
                        path,
                        key: None,
                        seen: HashMap::new(),
                        start: mark,
                    },
                    _ => Frame::Sequence {
                        path,
                        index: 0,
                        start: mark,
                    },
                });
            }
            Event::MappingEnd | Event::SequenceEnd => {
                self.stack.pop();
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_nested_fields_and_falls_back_to_ancestors() {
        let src = "listen: 0.0.0.0:8080\nroutes:\n  - name: a\n    policies:\n      - name: p\n        key: [client_ip]\n";
        let pos = Positions::index(src);
        assert_eq!(pos.find("listen"), Some(Position { line: 1, column: 9 }));
        assert_eq!(
            pos.find("routes[0].name"),
            Some(Position {
                line: 3,
                column: 11
            })
        );
        assert_eq!(
            pos.find("routes[0].policies[0].key[0]").map(|p| p.line),
            Some(6)
        );
        // Missing field: reported at the mapping that lacks it.
        assert_eq!(
            pos.find("routes[0].policies[0].token_bucket")
                .map(|p| p.line),
            Some(5)
        );
    }
}
