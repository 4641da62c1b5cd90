//! placeholder (elementwise)
