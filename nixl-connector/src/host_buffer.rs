//! Host-buffer mode.
