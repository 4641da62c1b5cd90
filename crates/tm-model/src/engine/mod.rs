//! The serving engine (in progress).
