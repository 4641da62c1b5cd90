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
        assert_eq!(kernels.len(), 15, "{kernels:?}");
        let src = modules().iter().find(|s| s.name == "elementwise.cu").expect("elementwise.cu").text;
        for k in &kernels {
            let defined = ["TM_KERNEL", "TM_KERNEL_BOUNDS", "TM_KERNEL_EARLY", "TM_KERNEL_BOUNDS_EARLY"]
                .iter()
                .any(|m| src.contains(&format!("{m}({k},")));
            assert!(defined, "elementwise.cu does not define `{k}`");
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
    fn gemv_images_define_every_abi_kernel() {
        let kernels = abi_kernels("gemv.cu");
        assert_eq!(kernels.len(), 8, "{kernels:?}");
        for a in artefacts().iter().filter(|a| a.module == "gemv") {
            let entries = entry_points(a.bytes);
            for k in &kernels {
                for dt in ["f32", "f16", "bf16"] {
                    assert!(entries.contains(&format!("{k}_{dt}")), "gemv ({:?}) lacks {k}_{dt}", a.target);
                }
            }
        }
    }

    #[test]
    fn collectives_define_every_abi_kernel() {
        let kernels = abi_kernels("collectives.cu");
        assert_eq!(
            kernels,
            [
                "peer_all_reduce",
                "peer_all_gather",
                "peer_all_reduce_add_rms_norm",
                "peer_all_reduce_ll",
                "peer_all_reduce_add_rms_norm_ll"
            ]
        );
        let src = modules().iter().find(|s| s.name == "collectives.cu").expect("collectives.cu").text;
        for k in &kernels {
            assert!(src.contains(&format!("TM_KERNEL_BOUNDS({k},")), "collectives.cu does not define `{k}`");
        }
        for a in artefacts().iter().filter(|a| a.module == "collectives") {
            let entries = entry_points(a.bytes);
            for k in &kernels {
                for dt in ["f32", "f16", "bf16"] {
                    assert!(entries.contains(&format!("{k}_{dt}")), "collectives ({:?}) lacks {k}_{dt}", a.target);
                }
            }
        }
    }

    #[test]
    fn q4_gemv_images_define_every_abi_kernel() {
        let kernels = abi_kernels("q4_gemv.cu");
        assert_eq!(
            kernels,
            [
                "q4_gemv_u2",
                "q4_gemv_n16",
                "q4_gemv_ln",
                "q4_gemv_ln4",
                "q4_gemv_lnt",
                "q4_gemv_ln4t",
                "q4_gemv_silu_u2",
                "q4_gemv_silu_ln",
                "q4_gemv_silu_ln4",
                "q4_gemv_silu_lnt",
                "q4_gemv_silu_lnts",
                "q4_gemv_silu_ln4t",
                "q4_gemv_ln_rope",
                "q4_gemv_lnt_rope",
                "q4_gemv_n16_join",
                "q4_gemv_ln_join",
                "q4_gemv_ln4_join",
                "q4_gemv_lnt_join",
                "q4_gemv_ln4t_join"
            ]
        );
        for a in artefacts().iter().filter(|a| a.module == "q4_gemv") {
            let entries = entry_points(a.bytes);
            for k in &kernels {
                for dt in ["f16", "bf16"] {
                    assert!(entries.contains(&format!("{k}_{dt}")), "q4_gemv ({:?}) lacks {k}_{dt}", a.target);
                }
            }
        }
    }

    #[test]
    fn q4_gemm_images_define_every_abi_kernel() {
        let kernels = abi_kernels("q4_gemm.cu");
        assert_eq!(kernels.len(), 4, "{kernels:?}");
        let src = modules().iter().find(|s| s.name == "q4_gemm.cu").expect("q4_gemm.cu").text;
        for k in &kernels {
            let tile = k.strip_prefix("matmul_q4_gemm_").expect("kernel name");
            assert!(src.contains(&format!("TMG_KERNEL({tile}, SUF")), "q4_gemm.cu does not define `{k}`");
        }
        for a in artefacts().iter().filter(|a| a.module == "q4_gemm") {
            let entries = entry_points(a.bytes);
            for k in &kernels {
                for dt in ["f16", "bf16"] {
                    assert!(entries.contains(&format!("{k}_{dt}")), "q4_gemm ({:?}) lacks {k}_{dt}", a.target);
                }
            }
            // The sm_90a wgmma kernels: in every image (trapping stubs outside sm_90a); the marker
            // only in the sm_90 cubin, which the build makes for sm_90a.
            for k in [
                "matmul_q4_gemm_w",
                "matmul_q4_gemm_v",
                "matmul_q4_gemm_u",
                "matmul_q4_gemm_y",
                "matmul_q4_gemm_z",
                "matmul_q4_gemm_x",
            ] {
                for dt in ["f16", "bf16"] {
                    assert!(entries.contains(&format!("{k}_{dt}")), "q4_gemm ({:?}) lacks {k}_{dt}", a.target);
                }
            }
            let marker = entries.iter().any(|e| e == "matmul_q4_gemm_sm90a");
            assert_eq!(marker, matches!(a.target, Target::Cubin { sm: 90 }), "marker in q4_gemm ({:?})", a.target);
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

/// The kernel entry points a module image defines: the global function symbols of a cubin (an
/// ELF file) or the `.entry` names of PTX text. Empty when the image is neither or is malformed;
/// the runtime then looks kernels up in that module by trying (see `tm_cuda::runtime`).
pub fn entry_points(image: &[u8]) -> Vec<String> {
    if image.starts_with(b"\x7fELF") {
        elf_functions(image).unwrap_or_default()
    } else {
        ptx_entries(&String::from_utf8_lossy(image))
    }
}

/// `.entry NAME(` lines of PTX.
fn ptx_entries(ptx: &str) -> Vec<String> {
    ptx.lines()
        .filter_map(|l| l.split_once(".entry").map(|(_, rest)| rest))
        .filter_map(|rest| rest.trim().split(|c: char| c == '(' || c.is_whitespace()).next())
        .filter(|n| !n.is_empty())
        .map(str::to_string)
        .collect()
}

/// The names of the `STT_FUNC` symbols with global binding in a little-endian ELF64 file.
fn elf_functions(elf: &[u8]) -> Option<Vec<String>> {
    let u16_at = |o: usize| Some(u16::from_le_bytes(elf.get(o..o + 2)?.try_into().ok()?));
    let u32_at = |o: usize| Some(u32::from_le_bytes(elf.get(o..o + 4)?.try_into().ok()?));
    let u64_at = |o: usize| Some(u64::from_le_bytes(elf.get(o..o + 8)?.try_into().ok()?) as usize);
    // ELFCLASS64, little-endian.
    if elf.get(4) != Some(&2) || elf.get(5) != Some(&1) {
        return None;
    }
    let (shoff, shentsize, shnum) = (u64_at(0x28)?, u16_at(0x3a)? as usize, u16_at(0x3c)? as usize);
    // Section header fields: sh_type at 4, sh_offset at 24, sh_size at 32, sh_link at 40,
    // sh_entsize at 56.
    let section = |i: usize| {
        let h = shoff.checked_add(i.checked_mul(shentsize)?)?;
        Some((u32_at(h + 4)?, u64_at(h + 24)?, u64_at(h + 32)?, u32_at(h + 40)? as usize, u64_at(h + 56)?))
    };
    const SHT_SYMTAB: u32 = 2;
    let mut names = Vec::new();
    for i in 0..shnum {
        let (kind, off, size, link, entsize) = section(i)?;
        if kind != SHT_SYMTAB || entsize < 24 {
            continue;
        }
        let (_, str_off, str_size, _, _) = section(link)?;
        let strtab = elf.get(str_off..str_off.checked_add(str_size)?)?;
        for s in 0..size / entsize {
            let sym = off + s * entsize;
            let (name, info) = (u32_at(sym)? as usize, *elf.get(sym + 4)?);
            // STT_FUNC (2) with STB_GLOBAL (1) binding.
            if info & 0xf != 2 || info >> 4 != 1 {
                continue;
            }
            let bytes = strtab.get(name..)?;
            let end = bytes.iter().position(|&b| b == 0)?;
            names.push(String::from_utf8_lossy(&bytes[..end]).into_owned());
        }
    }
    Some(names)
}

#[cfg(test)]
mod entry_point_tests {
    use super::*;

    #[test]
    fn ptx_entry_names() {
        let ptx = ".visible .entry rms_norm_bf16(\n\t.param .u64 p0\n)\n.entry attn_decode_d128_f16 (\n.func helper(";
        assert_eq!(ptx_entries(ptx), ["rms_norm_bf16", "attn_decode_d128_f16"]);
    }

    #[test]
    fn every_embedded_image_lists_its_kernels() {
        // Every image of a module (each arch's cubin, the PTX) defines the same kernels, but for
        // q4_gemm's marker of its sm_90a image (checked by `q4_gemm_images_define_every_abi_kernel`).
        let mut by_module = std::collections::HashMap::new();
        for a in artefacts() {
            let mut names = entry_points(a.bytes);
            names.sort();
            names.retain(|n| n != "matmul_q4_gemm_sm90a");
            assert!(!names.is_empty(), "{} ({:?}) lists no kernels", a.module, a.target);
            assert!(names.iter().all(|n| !n.is_empty() && n.is_ascii()), "{}: {names:?}", a.module);
            let first = by_module.entry(a.module).or_insert_with(|| names.clone());
            assert_eq!(*first, names, "{} ({:?}) defines other kernels than its other images", a.module, a.target);
        }
    }

    #[test]
    fn malformed_images_list_nothing() {
        assert!(entry_points(b"\x7fELF\x02\x01garbage").is_empty());
        assert!(entry_points(b"").is_empty());
    }
}
