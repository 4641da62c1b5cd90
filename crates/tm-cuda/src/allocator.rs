//! placeholder (allocator)
