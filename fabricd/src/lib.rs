//! fabricd
