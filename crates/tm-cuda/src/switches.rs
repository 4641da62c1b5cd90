//! On/off environment switches for A/B runs (`TM_PDL`, `TM_Q4_GEMM_SPLIT`, `TM_Q4_GEMM_GROUP`):
//! unset or anything but `0`, `off`, `false` means on.

/// Whether a switch's value means on (everything but `0`, `off`, `false`, any case; tested with
/// `TM_PDL`'s values in pdl.rs).
pub(crate) fn on(value: &str) -> bool {
    !matches!(value.trim().to_ascii_lowercase().as_str(), "0" | "off" | "false")
}

/// Whether the switch `var` is on (unset: on). Callers read it once (a `OnceLock`).
pub(crate) fn env_on(var: &str) -> bool {
    std::env::var(var).map_or(true, |v| on(&v))
}
