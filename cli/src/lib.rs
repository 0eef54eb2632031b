//! fabricctl
