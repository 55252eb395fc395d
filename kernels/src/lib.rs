//! The `Backend` traits and their CPU implementation.
