//! Errors of the sim backend, located in the config text by file, line, column and key.
//!
//! Both kinds of mistakes — TOML syntax and type errors found by `toml`, and semantic errors
//! found while building (unknown template, duplicate id, dangling link, bad count) — carry
//! the byte span of the offending text. [`Locator`] turns a span into `line:column` and the
//! dotted key path (`templates.hgx.gpu[0].count`) by walking the document's spanned tables.

use std::ops::Range;

use toml::Spanned;
use toml::de::{DeTable, DeValue};

/// Errors loading or building a sim fabric.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The file could not be read.
    #[error("{origin}: cannot read sim fabric")]
    Read {
        /// File name.
        origin: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The text is not valid TOML or does not match the schema.
    #[error("{origin}:{line}:{column}: key `{key}`: {message}")]
    Parse {
        /// File name (or `fuzz`, `<text>`).
        origin: String,
        /// 1-based line.
        line: usize,
        /// 1-based column (in characters).
        column: usize,
        /// Dotted key path of the offending value, or `<document>`.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// The config is well-formed but describes an impossible fabric.
    #[error("{origin}:{line}:{column}: key `{key}`: {message}")]
    Invalid {
        /// File name.
        origin: String,
        /// 1-based line.
        line: usize,
        /// 1-based column (in characters).
        column: usize,
        /// Dotted key path of the offending value, or `<document>`.
        key: String,
        /// What is wrong.
        message: String,
    },
}

impl SimError {
    /// The key path the error is about (`<document>` when it has none).
    pub fn key(&self) -> Option<&str> {
        match self {
            SimError::Read { .. } => None,
            SimError::Parse { key, .. } | SimError::Invalid { key, .. } => Some(key),
        }
    }

    /// The 1-based line the error is about.
    pub fn line(&self) -> Option<usize> {
        match self {
            SimError::Read { .. } => None,
            SimError::Parse { line, .. } | SimError::Invalid { line, .. } => Some(*line),
        }
    }
}

/// A semantic error before it is located: a message and the span of the offending value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Located {
    pub span: Range<usize>,
    pub message: String,
}

impl Located {
    pub fn new(span: Range<usize>, message: impl Into<String>) -> Self {
        Self { span, message: message.into() }
    }

    /// An error about a spanned value.
    pub fn at<T>(value: &Spanned<T>, message: impl Into<String>) -> Self {
        Self::new(value.span(), message)
    }
}

/// Converts spans of one document to positions and key paths.
pub(crate) struct Locator<'a> {
    text: &'a str,
    origin: &'a str,
}

impl<'a> Locator<'a> {
    pub fn new(text: &'a str, origin: &'a str) -> Self {
        Self { text, origin }
    }

    /// 1-based line and column (in characters) of a byte offset.
    pub fn line_col(&self, offset: usize) -> (usize, usize) {
        let mut at = offset.min(self.text.len());
        while !self.text.is_char_boundary(at) {
            at -= 1;
        }
        let before = &self.text[..at];
        let line = before.bytes().filter(|&b| b == b'\n').count() + 1;
        let line_start = before.rfind('\n').map_or(0, |p| p + 1);
        (line, before[line_start..].chars().count() + 1)
    }

    /// The dotted key path of the innermost value or key containing `offset`.
    pub fn key_path(&self, offset: usize) -> String {
        let (doc, _) = DeTable::parse_recoverable(self.text);
        let mut path = String::new();
        walk_table(doc.get_ref(), offset, &mut path);
        if path.is_empty() { "<document>".to_owned() } else { path }
    }

    pub fn syntax(&self, err: &toml::de::Error) -> SimError {
        let span = err.span().unwrap_or(0..0);
        let (line, column) = self.line_col(span.start);
        SimError::Parse {
            origin: self.origin.to_owned(),
            line,
            column,
            key: self.key_path(span.start),
            message: err.message().trim_end().to_owned(),
        }
    }

    pub fn semantic(&self, err: Located) -> SimError {
        let (line, column) = self.line_col(err.span.start);
        SimError::Invalid {
            origin: self.origin.to_owned(),
            line,
            column,
            key: self.key_path(err.span.start),
            message: err.message,
        }
    }
}

fn contains(span: &Range<usize>, offset: usize) -> bool {
    span.start <= offset && (offset < span.end || span.is_empty() && offset == span.start)
}

fn walk_table(table: &DeTable<'_>, offset: usize, path: &mut String) -> bool {
    for (k, v) in table.iter() {
        let in_key = contains(&k.span(), offset);
        if in_key || contains(&v.span(), offset) {
            if !path.is_empty() {
                path.push('.');
            }
            path.push_str(k.get_ref());
            if !in_key {
                walk_value(v.get_ref(), offset, path);
            }
            return true;
        }
    }
    // Tables declared with headers (`[[a.b]]`) do not always span their body: look inside.
    for (k, v) in table.iter() {
        let mark = path.len();
        if !path.is_empty() {
            path.push('.');
        }
        path.push_str(k.get_ref());
        if walk_value(v.get_ref(), offset, path) {
            return true;
        }
        path.truncate(mark);
    }
    false
}

fn walk_value(value: &DeValue<'_>, offset: usize, path: &mut String) -> bool {
    match value {
        DeValue::Table(t) => walk_table(t, offset, path),
        DeValue::Array(a) => {
            for (i, item) in a.iter().enumerate() {
                let mark = path.len();
                path.push_str(&format!("[{i}]"));
                if contains(&item.span(), offset) {
                    walk_value(item.get_ref(), offset, path);
                    return true;
                }
                if walk_value(item.get_ref(), offset, path) {
                    return true;
                }
                path.truncate(mark);
            }
            false
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_and_column_count_characters() {
        let l = Locator::new("a = 1\nbé = \"x\"\n", "t.toml");
        assert_eq!(l.line_col(0), (1, 1));
        assert_eq!(l.line_col(6), (2, 1));
        let off = "a = 1\nbé = ".len();
        assert_eq!(l.line_col(off), (2, 6));
    }

    #[test]
    fn key_paths_follow_tables_and_arrays() {
        let text = "[fabric]\nname = \"x\"\n\n[[templates.t.gpu]]\nname = \"g\"\ncount = 0\n";
        let l = Locator::new(text, "t.toml");
        let off = text.find("0\n").unwrap();
        assert_eq!(l.key_path(off), "templates.t.gpu[0].count");
        assert_eq!(l.key_path(text.find("\"x\"").unwrap()), "fabric.name");
    }
}
