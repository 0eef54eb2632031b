//! Discovery backends.
