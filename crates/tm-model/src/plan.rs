//! Memory planning (in progress).
