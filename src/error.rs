use std::fmt;

/// A failure with a message for a person. `Input` errors (bad files, flags, shapes) exit with
/// status 2; everything the tool cannot blame on its input is `Internal`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// The input (a file, an option, a batch) is at fault; the message says how.
    Input(String),
    /// An invariant of ghost-oracle itself was broken; the message says which.
    Internal(String),
    /// The reader of stdout went away (`| head`): not a failure, the run just ends.
    OutputClosed,
}

impl Error {
    /// An error in the input.
    pub fn input(msg: impl Into<String>) -> Self {
        Error::Input(msg.into())
    }

    /// A broken invariant of ghost-oracle itself.
    pub fn internal(msg: impl Into<String>) -> Self {
        Error::Internal(msg.into())
    }

    /// Prefixes the message with where it happened.
    pub fn context(self, what: impl fmt::Display) -> Self {
        match self {
            Error::Input(m) => Error::Input(format!("{what}: {m}")),
            Error::Internal(m) => Error::Internal(format!("{what}: {m}")),
            Error::OutputClosed => Error::OutputClosed,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Input(m) | Error::Internal(m) => f.write_str(m),
            Error::OutputClosed => f.write_str("stdout was closed"),
        }
    }
}

impl std::error::Error for Error {}

impl From<crate::accountant::AccountingError> for Error {
    fn from(e: crate::accountant::AccountingError) -> Self {
        Error::Input(e.to_string())
    }
}

impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Self {
        Error::Internal(format!("tensor operation failed: {e}"))
    }
}

impl From<ghost_oracle_reference::Error> for Error {
    fn from(e: ghost_oracle_reference::Error) -> Self {
        if e.is_internal() {
            Error::Internal(e.message().to_string())
        } else {
            Error::Input(e.message().to_string())
        }
    }
}

/// The library's result: every error is an [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
