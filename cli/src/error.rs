//! The tool's error: a one-line message and the process exit code.

use std::fmt;

/// Exit code for unusable input (missing, not a spool, corrupt) and bad arguments.
pub const EXIT_INPUT: i32 = 2;
/// Exit code for any other failure (writing the output, say).
pub const EXIT_OTHER: i32 = 1;

/// A failure the tool reports as one line on stderr before exiting.
#[derive(Debug)]
pub struct CliError {
    /// The message, without the `spulse: error: ` prefix.
    pub message: String,
    /// The exit code.
    pub code: i32,
}

impl CliError {
    /// An input error (exit code 2).
    pub fn input(message: impl Into<String>) -> CliError {
        CliError { message: message.into(), code: EXIT_INPUT }
    }

    /// Any other error (exit code 1).
    pub fn other(message: impl Into<String>) -> CliError {
        CliError { message: message.into(), code: EXIT_OTHER }
    }

    /// An error writing `what` (an output file, stdout).
    pub fn output(what: &str, e: std::io::Error) -> CliError {
        CliError::other(format!("{what}: {e}"))
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for CliError {}

impl From<spulse::Error> for CliError {
    fn from(e: spulse::Error) -> CliError {
        // Display already names the file and, for format errors, the byte offset.
        let one_line = e.to_string().replace('\n', " ");
        CliError::input(one_line)
    }
}
