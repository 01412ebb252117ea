//! Memory store end-to-end tests.
