use std::fmt;

/// Every failure of the reference is a message meant for a person: it names the file, tensor or
/// field at fault and says what was expected. Almost all are the input's fault; the few that
/// are the reference's own (a broken invariant) say so, so that no one is told to fix a file
/// that is fine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    message: String,
    internal: bool,
}

impl Error {
    /// The input (a file, a tensor, a field, a batch) is at fault.
    pub fn new(msg: impl Into<String>) -> Self {
        Error {
            message: msg.into(),
            internal: false,
        }
    }

    /// The reference itself is at fault: an invariant it keeps was broken.
    pub fn internal(msg: impl Into<String>) -> Self {
        Error {
            message: msg.into(),
            internal: true,
        }
    }

    /// What went wrong, for a person.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Whether the reference, not its input, is at fault.
    pub fn is_internal(&self) -> bool {
        self.internal
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

/// The reference's result: every error is an [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

macro_rules! bail {
    ($($arg:tt)*) => { return Err($crate::error::Error::new(format!($($arg)*))) };
}
pub(crate) use bail;
