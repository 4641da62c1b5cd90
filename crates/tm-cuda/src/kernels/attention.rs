//! placeholder (attention)
