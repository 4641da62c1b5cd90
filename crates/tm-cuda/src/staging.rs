//! placeholder (staging)
