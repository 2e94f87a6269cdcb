//! A YAML document as a tree of nodes that remember their source line.
//!
//! envoyproxy/ratelimit's files are small and hand-written, so a good error names the line. serde
//! loses positions once a value is deserialized, so the reader builds this tree from yaml-rust2's
//! marked events and validates it by hand (`config.rs`).

use yaml_rust2::parser::{Event, MarkedEventReceiver, Parser};
use yaml_rust2::scanner::{Marker, TScalarStyle};
use yaml_rust2::Yaml;

/// One YAML node and the 1-based line where it starts.
#[derive(Debug, Clone)]
pub(crate) struct Node {
    pub(crate) line: usize,
    pub(crate) value: Value,
}

/// A node's content. Scalars keep their source text: envoyproxy/ratelimit (yaml.v2) reads any
/// scalar into a string field as written, so `value: 30` is the string "30".
#[derive(Debug, Clone)]
pub(crate) enum Value {
    Null,
    Scalar { text: String, kind: ScalarKind },
    Seq(Vec<Node>),
    Map(Vec<(Node, Node)>),
}

/// What a scalar resolves to under the YAML core schema (quoted scalars are always strings).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ScalarKind {
    Str,
    Int,
    Float,
    Bool,
}

/// A document that could not be parsed, with its position.
#[derive(Debug)]
pub(crate) struct SyntaxError {
    pub(crate) line: usize,
    pub(crate) col: usize,
    pub(crate) message: String,
}

/// Parses `text` into its documents (an empty file has none).
pub(crate) fn parse(text: &str) -> Result<Vec<Node>, SyntaxError> {
    let mut builder = Builder::default();
    let mut parser = Parser::new_from_str(text);
    parser.load(&mut builder, true).map_err(|e| SyntaxError {
        line: e.marker().line(),
        col: e.marker().col() + 1,
        message: e.info().to_owned(),
    })?;
    match builder.error {
        Some(e) => Err(e),
        None => Ok(builder.docs),
    }
}

impl Value {
    /// The scalar's text, if it is one.
    pub(crate) fn as_text(&self) -> Option<&str> {
        match self {
            Value::Scalar { text, .. } => Some(text),
            _ => None,
        }
    }
}

/// A collection being built: its start line, anchor and children so far.
#[derive(Debug)]
enum Open {
    Seq(usize, usize, Vec<Node>),
    Map(usize, usize, Vec<(Node, Node)>, Option<Node>),
}

#[derive(Debug, Default)]
struct Builder {
    docs: Vec<Node>,
    stack: Vec<Open>,
    anchors: Vec<(usize, Node)>,
    error: Option<SyntaxError>,
}

impl Builder {
    fn finish(&mut self, node: Node, anchor: usize) {
        if anchor > 0 {
            self.anchors.push((anchor, node.clone()));
        }
        match self.stack.last_mut() {
            None => self.docs.push(node),
            Some(Open::Seq(_, _, items)) => items.push(node),
            Some(Open::Map(_, _, entries, pending)) => match pending.take() {
                None => *pending = Some(node),
                Some(key) => entries.push((key, node)),
            },
        }
    }
}

impl MarkedEventReceiver for Builder {
    fn on_event(&mut self, ev: Event, mark: Marker) {
        if self.error.is_some() {
            return;
        }
        let line = mark.line();
        match ev {
            Event::Scalar(text, style, anchor, tag) => {
                // Quoted scalars, and the rare explicitly tagged one (`!!str 5`), are strings.
                let value = if tag.is_some() || style != TScalarStyle::Plain {
                    Value::Scalar {
                        text,
                        kind: ScalarKind::Str,
                    }
                } else {
                    match Yaml::from_str(&text) {
                        Yaml::Null => Value::Null,
                        Yaml::Integer(_) => Value::Scalar {
                            text,
                            kind: ScalarKind::Int,
                        },
                        Yaml::Real(_) => Value::Scalar {
                            text,
                            kind: ScalarKind::Float,
                        },
                        Yaml::Boolean(_) => Value::Scalar {
                            text,
                            kind: ScalarKind::Bool,
                        },
                        _ => Value::Scalar {
                            text,
                            kind: ScalarKind::Str,
                        },
                    }
                };
                self.finish(Node { line, value }, anchor);
            }
            Event::SequenceStart(anchor, _) => self.stack.push(Open::Seq(line, anchor, Vec::new())),
            Event::MappingStart(anchor, _) => {
                self.stack.push(Open::Map(line, anchor, Vec::new(), None))
            }
            Event::SequenceEnd | Event::MappingEnd => match self.stack.pop() {
                Some(Open::Seq(line, anchor, items)) => {
                    let node = Node {
                        line,
                        value: Value::Seq(items),
                    };
                    self.finish(node, anchor);
                }
                Some(Open::Map(line, anchor, entries, _)) => {
                    let node = Node {
                        line,
                        value: Value::Map(entries),
                    };
                    self.finish(node, anchor);
                }
                None => {
                    self.error = Some(SyntaxError {
                        line,
                        col: mark.col() + 1,
                        message: "unbalanced collection end".to_owned(),
                    })
                }
            },
            Event::Alias(anchor) => match self.anchors.iter().rev().find(|(id, _)| *id == anchor) {
                Some((_, node)) => {
                    let node = node.clone();
                    self.finish(node, 0);
                }
                None => {
                    self.error = Some(SyntaxError {
                        line,
                        col: mark.col() + 1,
                        message: "alias to an unknown anchor".to_owned(),
                    })
                }
            },
            Event::StreamStart
            | Event::StreamEnd
            | Event::DocumentStart
            | Event::DocumentEnd
            | Event::Nothing => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_lines_and_scalar_kinds() {
        let docs = parse("a: 1\nb:\n  - x: 'y'\n    z: 0.25\nc:\n").unwrap();
        assert_eq!(docs.len(), 1);
        let Value::Map(entries) = &docs[0].value else {
            panic!("not a map")
        };
        assert_eq!(entries.len(), 3);
        assert_eq!(entries[0].0.value.as_text(), Some("a"));
        assert!(matches!(
            entries[0].1.value,
            Value::Scalar {
                kind: ScalarKind::Int,
                ..
            }
        ));
        assert_eq!(entries[1].0.line, 2);
        let Value::Seq(items) = &entries[1].1.value else {
            panic!("not a seq")
        };
        assert_eq!(items[0].line, 3);
        let Value::Map(inner) = &items[0].value else {
            panic!("not a map")
        };
        assert!(matches!(
            inner[0].1.value,
            Value::Scalar {
                kind: ScalarKind::Str,
                ..
            }
        ));
        assert_eq!(inner[1].0.line, 4);
        assert!(matches!(entries[2].1.value, Value::Null));
    }

    #[test]
    fn resolves_aliases() {
        let docs = parse("a: &x {k: v}\nb: *x\n").unwrap();
        let Value::Map(entries) = &docs[0].value else {
            panic!("not a map")
        };
        assert!(matches!(entries[1].1.value, Value::Map(_)));
    }

    #[test]
    fn reports_syntax_errors_with_a_line() {
        let err = parse("a: 1\n'''\n").unwrap_err();
        assert!(err.line >= 2, "{err:?}");
    }

    #[test]
    fn empty_text_has_no_document() {
        assert!(parse("").unwrap().is_empty());
        assert!(parse("# only a comment\n").unwrap().is_empty());
    }
}
