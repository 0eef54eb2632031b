//! Wire types shared by fabricd, libfabric-mm and fabricctl.
