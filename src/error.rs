//! The one error type of the prefill/decode demo.

/// Result alias used across the demo library.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can stop a prefill session or a decode run.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A NIXL call failed.
    #[error(transparent)]
    Nixl(#[from] nixl::Error),
    /// A socket or other I/O operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The KV connector failed (setup, side channel, handshake or a load).
    #[error(transparent)]
    Connector(#[from] nixl_connector::Error),
    /// The peer sent a message that breaks the control-channel protocol.
    #[error("control-channel protocol error: {0}")]
    Protocol(String),
    /// The address decode was given answers, but not as a prefill's control channel: what
    /// it reached, what was expected, and which address to give instead.
    #[error("{0}")]
    NotAPrefill(String),
    /// The peer refused the session and said why.
    #[error("rejected by the peer: {0}")]
    Rejected(String),
    /// A READ of a request's blocks failed or passed its timeout.
    #[error("{0}")]
    LoadFailed(String),
    /// The peer went away before the work was done.
    #[error("{0}")]
    PeerGone(String),
    /// This worker turned a peer away to stay within its limits.
    #[error("{0}")]
    Busy(String),
    /// Something did not happen in time.
    #[error("timed out: {0}")]
    Timeout(String),
    /// Sizes, flags or configuration that cannot work.
    #[error("invalid configuration: {0}")]
    Config(String),
}

impl Error {
    /// An [`Error::Io`] with the operation that failed.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}
