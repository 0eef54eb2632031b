//! Which process made an object. A forked child has copies of the parent's library objects
//! but neither its session (the connection is the parent's; the reader thread was not
//! copied) nor the memory kept out of children (`MADV_DONTFORK`: holes in the child, where
//! the child's own mappings may land): a copy used or dropped in the child acts on neither.

/// The process an object was made in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Origin(u32);

impl Origin {
    /// This process.
    pub(crate) fn here() -> Self {
        Self(std::process::id())
    }

    /// Whether this process is another than the one the object was made in (a forked
    /// child of it).
    pub(crate) fn forked(self) -> bool {
        std::process::id() != self.0
    }
}
