//! libfabric-mm
