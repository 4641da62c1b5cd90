//! placeholder (quant)
