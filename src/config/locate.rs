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

/// Positions of every node of a document, by field path.
#[derive(Debug, Default)]
pub struct Positions {
    by_path: HashMap<String, Position>,
}

impl Positions {
    /// Indexes `source`. A document the event parser rejects yields no positions: serde will
    /// report that error itself, with its own location.
    pub fn index(source: &str) -> Self {
        let mut walker = Walker::default();
        let mut parser = Parser::new_from_str(source);
        if parser.load(&mut walker, false).is_err() {
            return Positions::default();
        }
        Positions {
            by_path: walker.by_path,
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
    Mapping { path: String, key: Option<String> },
    Sequence { path: String, index: usize },
}

#[derive(Default)]
struct Walker {
    stack: Vec<Frame>,
    by_path: HashMap<String, Position>,
}

impl Walker {
    /// The path of a node starting now, or `None` when the node is a mapping key.
    fn node_path(&mut self) -> Option<String> {
        match self.stack.last_mut() {
            None => Some(String::new()),
            Some(Frame::Mapping { key: None, .. }) => None,
            Some(Frame::Mapping { path, key }) => {
                let key = key.take().unwrap_or_default();
                Some(if path.is_empty() {
                    key
                } else {
                    format!("{path}.{key}")
                })
            }
            Some(Frame::Sequence { path, index }) => {
                let p = format!("{path}[{index}]");
                *index += 1;
                Some(p)
            }
        }
    }

    fn record(&mut self, path: &str, mark: Marker) {
        self.by_path.entry(path.to_string()).or_insert(Position {
            line: mark.line(),
            column: mark.col() + 1,
        });
    }
}

impl MarkedEventReceiver for Walker {
    fn on_event(&mut self, event: Event, mark: Marker) {
        match event {
            Event::Scalar(value, ..) => match self.node_path() {
                Some(path) => self.record(&path, mark),
                None => {
                    if let Some(Frame::Mapping { key, .. }) = self.stack.last_mut() {
                        *key = Some(value);
                    }
                }
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
                    Event::MappingStart(..) => Frame::Mapping { path, key: None },
                    _ => Frame::Sequence { path, index: 0 },
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
