//! The CUDA kernels: embedded sources and compiled artefacts.
//!
//! `build.rs` embeds every `cuda/*.cu` (a module) and `cuda/*.cuh` (a header), sorted by name,
//! and the cubins/PTX that [`BUILD_COMMAND`] wrote to `$TM_KERNELS_DIR` (default
//! `<workspace>/target/kernels`) — only when that directory's `manifest.txt` says they were built
//! from exactly these sources. Otherwise (a fresh clone, or edited sources) [`artefacts`] is empty
//! and the runtime compiles [`modules`] with NVRTC.

use generated::{ARTEFACTS, HEADERS, MODULES};

mod generated {
    #[allow(unused_imports)] // `Target` is unused when no artefacts are embedded
    use super::{Artefact, Source, Target};
    include!(concat!(env!("OUT_DIR"), "/cuda_kernels.rs"));
}

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
    ARTEFACTS
}

/// The `.cu` module sources.
pub fn modules() -> &'static [Source] {
    MODULES
}

/// The `.cuh` headers the modules include.
pub fn headers() -> &'static [Source] {
    HEADERS
}

/// sha256 of the embedded sources: for each `.cu` and `.cuh` file sorted by name,
/// `name \n byte-length \n bytes` (what `manifest.txt` records as `sources`). Also a good key
/// for caching NVRTC output.
pub fn source_digest() -> &'static str {
    generated::SOURCE_DIGEST
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel names of one `## {module}` section's code block in ABI.md.
    fn abi_kernels(module: &str) -> Vec<String> {
        let abi = include_str!("../cuda/ABI.md");
        let section = abi.split(&format!("## {module}")).nth(1).expect("ABI section");
        let block = section.split("```").nth(1).expect("ABI code block");
        block
            .lines()
            .filter_map(|l| l.split_once("_T(").map(|(name, _)| name.trim().to_string()))
            .filter(|n| !n.is_empty())
            .collect()
    }

    #[test]
    fn sources_are_embedded_sorted() {
        let names: Vec<&str> = modules().iter().map(|s| s.name).collect();
        assert!(names.contains(&"elementwise.cu"), "{names:?}");
        assert!(names.windows(2).all(|w| w[0] < w[1]));
        assert!(headers().iter().any(|h| h.name == "common.cuh"));
        assert!(modules().iter().chain(headers()).all(|s| !s.text.is_empty()));
        assert_eq!(source_digest().len(), 64);
    }

    #[test]
    fn elementwise_defines_every_abi_kernel() {
        let kernels = abi_kernels("elementwise.cu");
        assert_eq!(kernels.len(), 11, "{kernels:?}");
        let src = modules().iter().find(|s| s.name == "elementwise.cu").expect("elementwise.cu").text;
        for k in &kernels {
            assert!(
                src.contains(&format!("TM_KERNEL({k},")) || src.contains(&format!("TM_KERNEL_BOUNDS({k},")),
                "elementwise.cu does not define `{k}`"
            );
        }
        // When the kernels were built, the PTX must export every dtype variant.
        for a in artefacts().iter().filter(|a| a.module == "elementwise" && matches!(a.target, Target::Ptx { .. })) {
            let ptx = std::str::from_utf8(a.bytes).expect("PTX is text");
            for k in &kernels {
                for dt in ["f32", "f16", "bf16"] {
                    assert!(ptx.contains(&format!(".entry {k}_{dt}(")), "PTX lacks {k}_{dt}");
                }
            }
        }
    }

    #[test]
    fn artefacts_are_consistent() {
        let modules: Vec<&str> = modules().iter().map(|s| s.name.trim_end_matches(".cu")).collect();
        for a in artefacts() {
            assert!(modules.contains(&a.module), "artefact for unknown module {}", a.module);
            assert!(!a.bytes.is_empty());
        }
        let arches = embedded_arches();
        assert!(arches.windows(2).all(|w| w[0] < w[1]));
        println!("embedded CUDA artefacts: {}, cubin arches: {arches:?}", artefacts().len());
    }
}
