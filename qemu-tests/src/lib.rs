//! qemu-tests
