//! placeholder (sampling)
