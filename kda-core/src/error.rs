//! The one error type of the workspace: every contract violation names the argument, what was
//! expected and what came.

use std::fmt;

/// What went wrong, without the details; tests and callers match on this.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// A tensor has the wrong rank or extent.
    Shape,
    /// A tensor has a dtype the contract does not allow here.
    DType,
    /// A value is outside its allowed range (beta outside `[0, 1]`, non-finite entries, lb, ...).
    Value,
    /// Segment metadata (`cu_seqlens`, `segment_ids`) is malformed.
    Segments,
    /// A required argument is missing (for example `a_log` for an in-kernel gate).
    Missing,
    /// The input is valid but beyond what this library (or backend) supports.
    Unsupported,
    /// A backend failed at run time (plugin, compile, transfer, execute).
    Backend,
    /// Reading or writing a file failed.
    Io,
}

/// The error a backend failure came from, shared so that [`KdaError`] stays `Clone`.
pub type ErrorSource = std::sync::Arc<dyn std::error::Error + Send + Sync + 'static>;

/// A typed error: the kind, the argument it concerns, what was expected and what came, and for
/// a backend failure the backend's own error ([`std::error::Error::source`]; downcast it to
/// match on the backend's variants). Equality ignores the source.
#[derive(Debug, Clone)]
pub struct KdaError {
    kind: ErrorKind,
    arg: String,
    expected: String,
    got: String,
    source: Option<ErrorSource>,
}

impl PartialEq for KdaError {
    fn eq(&self, other: &Self) -> bool {
        (self.kind, &self.arg, &self.expected, &self.got)
            == (other.kind, &other.arg, &other.expected, &other.got)
    }
}

/// Constructors `name(arg, expected, got)` of errors of one kind: `name => Kind;`.
macro_rules! kind_constructors {
    ($($(#[$doc:meta])* $name:ident => $kind:ident;)*) => {$(
        $(#[$doc])*
        pub fn $name(arg: impl Into<String>, expected: impl Into<String>, got: impl Into<String>) -> Self {
            Self::new(ErrorKind::$kind, arg, expected, got)
        }
    )*};
}

impl KdaError {
    /// Builds an error of any kind.
    pub fn new(
        kind: ErrorKind,
        arg: impl Into<String>,
        expected: impl Into<String>,
        got: impl Into<String>,
    ) -> Self {
        Self { kind, arg: arg.into(), expected: expected.into(), got: got.into(), source: None }
    }
    /// The same error, caused by `source` (returned by [`std::error::Error::source`]).
    pub fn with_source(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(std::sync::Arc::new(source));
        self
    }
    kind_constructors! {
        /// Wrong rank or extent of `arg`.
        shape => Shape;
        /// Wrong dtype of `arg`.
        dtype => DType;
        /// A value of `arg` outside its range.
        value => Value;
        /// Malformed segment metadata in `arg`.
        segments => Segments;
    }
    /// `arg` is required by `why` but was not given.
    pub fn missing(arg: impl Into<String>, why: impl Into<String>) -> Self {
        Self::new(ErrorKind::Missing, arg, why, "nothing")
    }
    /// `arg` exceeds the supported `limit`.
    pub fn unsupported(arg: impl Into<String>, limit: impl Into<String>, got: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unsupported, arg, limit, got)
    }
    /// A backend failure during `stage` with the backend's own message.
    pub fn backend(stage: impl Into<String>, hint: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Backend, stage, hint, message)
    }
    /// An I/O failure on `path`.
    pub fn io(path: impl Into<String>, expected: impl Into<String>, got: impl Into<String>) -> Self {
        Self::new(ErrorKind::Io, path, expected, got)
    }

    /// The kind of failure.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }
    /// The argument (or stage, or path) the error concerns.
    pub fn arg(&self) -> &str {
        &self.arg
    }
    /// What the contract expected.
    pub fn expected(&self) -> &str {
        &self.expected
    }
    /// What actually came.
    pub fn got(&self) -> &str {
        &self.got
    }
    /// The same error about another argument name (used when a helper validated a renamed input).
    pub fn with_arg(mut self, arg: impl Into<String>) -> Self {
        self.arg = arg.into();
        self
    }
}

impl fmt::Display for KdaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            ErrorKind::Missing => write!(f, "missing argument `{}`: {}", self.arg, self.expected),
            ErrorKind::Unsupported => write!(
                f,
                "unsupported `{}`: supported limit is {}, got {}",
                self.arg, self.expected, self.got
            ),
            ErrorKind::Backend => {
                write!(f, "backend failure during {}: {} ({})", self.arg, self.got, self.expected)
            }
            ErrorKind::Io => write!(f, "{}: {} (expected {})", self.arg, self.got, self.expected),
            kind => write!(
                f,
                "invalid {} of `{}`: expected {}, got {}",
                kind_word(kind),
                self.arg,
                self.expected,
                self.got
            ),
        }
    }
}

fn kind_word(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::Shape => "shape",
        ErrorKind::DType => "dtype",
        ErrorKind::Value => "value",
        ErrorKind::Segments => "segments",
        _ => "argument",
    }
}

impl std::error::Error for KdaError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_deref().map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// The workspace-wide result alias.
pub type Result<T, E = KdaError> = std::result::Result<T, E>;
