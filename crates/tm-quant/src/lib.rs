//! tm-quant: group-wise int4/int8 weights in the layout of [`tm_core::quant`].
