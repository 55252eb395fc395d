//! Black-box tests live under `tests/`.
