//! The CUDA kernels: embedded sources and compiled artefacts.

/// What an embedded artefact holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// Machine code for compute capability `sm / 10`.`sm % 10` (e.g. 87 = sm_87).
    Cubin {
        /// The arch number, e.g. 90.
        sm: u32,
    },
    /// PTX for `compute_<sm>`, JIT-compiled by the driver on any newer device.
    Ptx {
        /// The arch number, e.g. 90.
        sm: u32,
    },
}

/// One compiled module for one target.
#[derive(Clone, Copy, Debug)]
pub struct Artefact {
    /// Module name: the `.cu` file's stem, e.g. `elementwise`.
    pub module: &'static str,
    /// What `bytes` is.
    pub target: Target,
    /// The cubin or the PTX text.
    pub bytes: &'static [u8],
}

/// One embedded source file.
#[derive(Clone, Copy, Debug)]
pub struct Source {
    /// File name, e.g. `elementwise.cu` or `common.cuh`.
    pub name: &'static str,
    /// Its text.
    pub text: &'static str,
}

/// The command that builds the artefacts for every supported arch.
pub const BUILD_COMMAND: &str = "cargo xtask build-kernels --arch sm_80,sm_86,sm_87,sm_89,sm_90";

/// Every artefact embedded at build time (empty when the kernels were not built).
pub fn artefacts() -> &'static [Artefact] {
    &[]
}

/// The `.cu` module sources.
pub fn modules() -> &'static [Source] {
    &[]
}

/// The `.cuh` headers the modules include.
pub fn headers() -> &'static [Source] {
    &[]
}

/// The arch numbers with an embedded cubin, sorted, deduplicated.
pub fn embedded_arches() -> Vec<u32> {
    let mut arches: Vec<u32> = artefacts()
        .iter()
        .filter_map(|a| match a.target {
            Target::Cubin { sm } => Some(sm),
            Target::Ptx { .. } => None,
        })
        .collect();
    arches.sort_unstable();
    arches.dedup();
    arches
}
