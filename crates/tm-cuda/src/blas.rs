//! placeholder (blas)
