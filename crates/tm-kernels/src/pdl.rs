//! Which CUDA kernels are safe to launch with programmatic dependent launch (PDL).
//!
//! With PDL (sm_90+) a kernel may start before the kernel before it has finished; it must call
//! `tmk::pdl_wait()` (common.cuh) before it reads that kernel's output, writes global memory or
//! returns (see ABI.md, "Programmatic dependent launch"). This module scans the embedded sources
//! for `__global__` functions whose body does not: the runtime launches the kernels of a module
//! with such a function without the PDL attribute, and the test
//! `every_kernel_waits_for_its_predecessors` keeps the list of such kernels explicit.
//!
//! The scan is textual: comments are removed, each `__global__` definition's body is found by
//! brace matching (macro definitions included: `TM_KERNEL_ONE_` in common.cuh is checked like any
//! other), and the body must contain `pdl_wait(` before its first `return`. It cannot check that
//! nothing is read before the wait; review does that.

use std::sync::OnceLock;

use crate::cuda::{headers, modules};

/// A `__global__` function that does not wait for its predecessors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NoWait {
    /// The function's name as written in the source (macro pastes included), e.g.
    /// `attn_combine_##SUF`.
    pub name: String,
    /// Why it fails: no `pdl_wait(` at all, or a `return` before it.
    pub reason: &'static str,
}

/// The `__global__` definitions of `source` (CUDA C++ text) that do not call `pdl_wait(` before
/// their first `return`, and the number of definitions found.
pub fn kernels_without_wait(source: &str) -> (Vec<NoWait>, usize) {
    let text = strip_comments(source);
    let mut missing = Vec::new();
    let mut found = 0;
    let mut rest = text.as_str();
    while let Some(at) = rest.find("__global__") {
        let after = &rest[at + "__global__".len()..];
        // A declaration ends at `;` before any `{`; a definition's body starts at the first `{`.
        let Some(open) = after.find('{') else { break };
        if after[..open].contains(';') {
            rest = after;
            continue;
        }
        let Some(len) = body_len(&after[open..]) else { break };
        let body = &after[open..open + len];
        found += 1;
        let name = kernel_name(&after[..open]);
        let wait = find_token(body, "pdl_wait(");
        let ret = find_token(body, "return");
        match (wait, ret) {
            (None, _) => missing.push(NoWait { name, reason: "never calls pdl_wait()" }),
            (Some(w), Some(r)) if r < w => missing.push(NoWait { name, reason: "returns before pdl_wait()" }),
            _ => {}
        }
        rest = &after[open + len..];
    }
    (missing, found)
}

/// Whether every kernel of module `module` (e.g. `elementwise`) and of every header waits for its
/// predecessors, i.e. the module's kernels may be launched with PDL. Unknown modules: `false`.
pub fn module_waits(module: &str) -> bool {
    static READY: OnceLock<Vec<(&'static str, bool)>> = OnceLock::new();
    let ready = READY.get_or_init(|| {
        let headers_wait = headers().iter().all(|h| kernels_without_wait(h.text).0.is_empty());
        modules()
            .iter()
            .map(|m| (m.name.trim_end_matches(".cu"), headers_wait && kernels_without_wait(m.text).0.is_empty()))
            .collect()
    });
    ready.iter().any(|&(m, ok)| m == module && ok)
}

/// `source` with `//` and `/* */` comments replaced by spaces (string literals are not special:
/// the kernel sources have no `//` or `/*` inside strings).
fn strip_comments(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    loop {
        let line = rest.find("//");
        let block = rest.find("/*");
        let (start, end_marker) = match (line, block) {
            (Some(l), Some(b)) if b < l => (b, "*/"),
            (Some(l), _) => (l, "\n"),
            (None, Some(b)) => (b, "*/"),
            (None, None) => break,
        };
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        match after.find(end_marker) {
            Some(e) if end_marker == "\n" => {
                out.push(' ');
                rest = &after[e..];
            }
            Some(e) => {
                out.push(' ');
                rest = &after[e + 2..];
            }
            None => {
                rest = "";
                break;
            }
        }
    }
    out.push_str(rest);
    out
}

/// The length of the brace-balanced block that `s` starts with (`s` starts with `{`).
fn body_len(s: &str) -> Option<usize> {
    let mut depth = 0usize;
    for (i, c) in s.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
    }
    None
}

/// The first occurrence of `token` in `s` that is not part of a longer identifier.
fn find_token(s: &str, token: &str) -> Option<usize> {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let open_end = token.ends_with(ident);
    s.match_indices(token)
        .map(|(i, _)| i)
        .find(|&i| !(s[..i].ends_with(ident) || open_end && s[i + token.len()..].starts_with(ident)))
}

/// The kernel's name from the text between `__global__` and its body: the last identifier (with
/// `##` pastes) before the parameter list, skipping the return type and `__launch_bounds__(..)`.
fn kernel_name(head: &str) -> String {
    let head: String = head.chars().map(|c| if c == '\\' || c.is_whitespace() { ' ' } else { c }).collect();
    let mut words = Vec::new();
    let mut rest = head.trim();
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix("__launch_bounds__") {
            // Skip the balanced parenthesised arguments.
            let mut depth = 0usize;
            let mut end = after.len();
            for (i, c) in after.char_indices() {
                match c {
                    '(' => depth += 1,
                    ')' => {
                        depth = depth.saturating_sub(1);
                        if depth == 0 {
                            end = i + 1;
                            break;
                        }
                    }
                    _ => {}
                }
            }
            rest = after[end..].trim_start();
            continue;
        }
        let end = rest.find([' ', '(']).unwrap_or(rest.len());
        if end == 0 {
            // The parameter list: the name is the word before it.
            break;
        }
        words.push(&rest[..end]);
        rest = rest[end..].trim_start();
    }
    words.last().map_or_else(|| head.trim().to_string(), |w| w.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Kernels known not to wait yet: (file, name as written). Their modules are launched
    /// without PDL until they do; empty this list as they are fixed.
    const PENDING: &[(&str, &str)] = &[];

    #[test]
    fn every_kernel_waits_for_its_predecessors() {
        let mut problems = Vec::new();
        for src in headers().iter().chain(modules()) {
            let (missing, found) = kernels_without_wait(src.text);
            if src.name.ends_with(".cu") {
                // Kernels are defined by hand or through the (checked) TM_KERNEL wrappers.
                let wrapped = ["TM_KERNEL(", "TM_KERNEL_BOUNDS(", "TM_KERNEL_EARLY(", "TM_KERNEL_BOUNDS_EARLY("]
                    .iter()
                    .any(|m| src.text.contains(m));
                assert!(found > 0 || wrapped, "{}: no kernel found; is the scan broken?", src.name);
            }
            for m in &missing {
                if !PENDING.contains(&(src.name, m.name.as_str())) {
                    problems.push(format!(
                        "{}: kernel `{}` {} (call tmk::pdl_launch_dependents(); tmk::pdl_wait(); at the top of \
                         its body: see ABI.md, \"Programmatic dependent launch\")",
                        src.name, m.name, m.reason
                    ));
                }
            }
            for &(file, name) in PENDING.iter().filter(|(f, _)| *f == src.name) {
                if !missing.iter().any(|m| m.name == name) {
                    problems.push(format!("{file}: kernel `{name}` now waits (or is gone): remove it from PENDING"));
                }
            }
        }
        assert!(PENDING.iter().all(|(f, _)| modules().iter().any(|m| m.name == *f)), "PENDING names unknown files");
        assert!(problems.is_empty(), "{}", problems.join("\n"));
        // The TM_KERNEL wrapper itself is one of the checked definitions.
        let common = headers().iter().find(|h| h.name == "common.cuh").expect("common.cuh");
        assert_eq!(kernels_without_wait(common.text), (vec![], 1), "common.cuh's TM_KERNEL_ONE_ must wait");
    }

    #[test]
    fn compiled_kernels_wait_for_their_predecessors() {
        // When the kernels were built: every entry of the sm_90+ PTX of a module that waits
        // executes `griddepcontrol.wait` (the hooks are compiled out below sm_90).
        for a in crate::cuda::artefacts() {
            let crate::cuda::Target::Ptx { sm } = a.target else { continue };
            if sm < 90 || !module_waits(a.module) {
                continue;
            }
            let ptx = std::str::from_utf8(a.bytes).expect("PTX is text");
            let entries: Vec<&str> = ptx.split(".entry ").skip(1).collect();
            assert!(!entries.is_empty(), "{}: PTX without entries", a.module);
            for e in entries {
                let name = e.split(['(', ' ', '\n']).next().unwrap_or_default();
                assert!(e.contains("griddepcontrol.wait"), "{} compute_{sm}: `{name}` never waits", a.module);
            }
        }
    }

    #[test]
    fn pending_modules_are_launched_without_pdl() {
        for m in modules() {
            let module = m.name.trim_end_matches(".cu");
            let pending = PENDING.iter().any(|(f, _)| *f == m.name);
            assert_eq!(module_waits(module), !pending, "{module}");
        }
        assert!(!module_waits("no_such_module"));
    }

    #[test]
    fn scan_finds_kernels_that_do_not_wait() {
        let src = r#"
            // __global__ void in_a_comment() { }
            /* __global__ void in_a_block_comment() { } */
            __global__ void declared_only(int n);
            extern "C" __global__ void __launch_bounds__(256, 2) good(int n) {
                tmk::pdl_launch_dependents();
                tmk::pdl_wait();
                if (n) { return; }
            }
            __global__ void returned_late(int returned) { tmk::pdl_wait(); if (returned) return; }
            extern "C" __global__ void never(int n) { if (n) { n += 1; } }
            #define K(SUF) \
                extern "C" __global__ void early_##SUF(int n) { \
                    if (n == 0) return; \
                    tmk::pdl_wait(); \
                }
            __global__ void not_quite(int n) { my_pdl_wait(); }
        "#;
        let (missing, found) = kernels_without_wait(src);
        assert_eq!(found, 5);
        let names: Vec<(&str, &str)> = missing.iter().map(|m| (m.name.as_str(), m.reason)).collect();
        assert_eq!(
            names,
            [
                ("never", "never calls pdl_wait()"),
                ("early_##SUF", "returns before pdl_wait()"),
                ("not_quite", "never calls pdl_wait()"),
            ]
        );
    }

    #[test]
    fn names_skip_launch_bounds_and_return_type() {
        assert_eq!(
            kernel_name(" void __launch_bounds__(tmq::THREADS, (2)) \\\n  foo_##SUF(int a, int b) "),
            "foo_##SUF"
        );
        assert_eq!(kernel_name(" void bounds name##_##sfx PARAMS "), "PARAMS");
    }
}
