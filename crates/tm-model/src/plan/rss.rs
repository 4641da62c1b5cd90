//! What the process really holds in host memory, to set against the plan: `/proc/self/status`
//! (`VmRSS`, `VmHWM`, `RssAnon`, `RssFile`, `RssShmem`) and a sampler that records the peak of
//! the anonymous part while something runs.
//!
//! The anonymous part is what matters for "never a second copy of the weights": file-backed
//! resident pages (`RssFile`) of a memory-mapped checkpoint are clean page cache, which the
//! kernel can drop at any time, except where they are pinned for zero-copy weights (then they
//! *are* the weights). `VmHWM` (the kernel's peak of `VmRSS`) counts both.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// Resident memory of this process in bytes (0 for fields the kernel does not report).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProcStatus {
    /// `VmRSS`: resident now.
    pub vm_rss: u64,
    /// `VmHWM`: the peak of `VmRSS` since start (or since [`reset_peak`]).
    pub vm_hwm: u64,
    /// `RssAnon`: anonymous resident memory (heap, pinned host buffers, copies).
    pub rss_anon: u64,
    /// `RssFile`: resident file-backed pages (mapped checkpoint, libraries).
    pub rss_file: u64,
    /// `RssShmem`: resident shared memory.
    pub rss_shmem: u64,
}

impl ProcStatus {
    /// Parses the text of `/proc/self/status`.
    pub fn parse(text: &str) -> ProcStatus {
        let field = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                .map_or(0, |kb| kb * 1024)
        };
        ProcStatus {
            vm_rss: field("VmRSS"),
            vm_hwm: field("VmHWM"),
            rss_anon: field("RssAnon"),
            rss_file: field("RssFile"),
            rss_shmem: field("RssShmem"),
        }
    }

    /// This process's figures now; `None` where `/proc/self/status` cannot be read (not Linux).
    pub fn read() -> Option<ProcStatus> {
        let s = ProcStatus::parse(&std::fs::read_to_string("/proc/self/status").ok()?);
        (s.vm_rss > 0).then_some(s)
    }
}

/// Resets `VmHWM` to the current `VmRSS` (writes `5` to `/proc/self/clear_refs`, Linux 4.0+), so
/// that a later `VmHWM` is the peak of what follows. Returns whether it worked.
pub fn reset_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Peaks recorded by an [`RssSampler`], in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RssPeaks {
    /// Figures when sampling started.
    pub start: ProcStatus,
    /// Highest `RssAnon` seen.
    pub anon: u64,
    /// Highest `RssFile` seen.
    pub file: u64,
    /// Highest `VmRSS` seen (the kernel's `VmHWM` at the end when it was reset at the start).
    pub rss: u64,
    /// Samples taken.
    pub samples: u64,
}

impl RssPeaks {
    /// How much the anonymous part grew at its peak over where it started.
    pub fn anon_growth(&self) -> u64 {
        self.anon.saturating_sub(self.start.rss_anon)
    }
}

/// Samples `/proc/self/status` on a thread every `interval` until stopped, keeping the peaks.
/// Anonymous memory has no kernel high-water mark, so a buffer that lives shorter than the
/// interval can be missed: use an interval well below the lifetime of what is measured.
pub struct RssSampler {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<RssPeaks>>,
}

impl RssSampler {
    /// Starts sampling (and resets `VmHWM`); `None` where `/proc/self/status` cannot be read.
    pub fn start(interval: Duration) -> Option<RssSampler> {
        let reset = reset_peak();
        let start = ProcStatus::read()?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let handle = std::thread::Builder::new()
            .name("tm-rss-sampler".into())
            .spawn(move || {
                let mut p =
                    RssPeaks { start, anon: start.rss_anon, file: start.rss_file, rss: start.vm_rss, samples: 0 };
                loop {
                    let done = flag.load(Ordering::Acquire);
                    if let Some(s) = ProcStatus::read() {
                        p.anon = p.anon.max(s.rss_anon);
                        p.file = p.file.max(s.rss_file);
                        p.rss = p.rss.max(s.vm_rss);
                        if reset {
                            p.rss = p.rss.max(s.vm_hwm);
                        }
                        p.samples += 1;
                    }
                    if done {
                        return p;
                    }
                    std::thread::sleep(interval);
                }
            })
            .ok()?;
        Some(RssSampler { stop, handle: Some(handle) })
    }

    /// Stops sampling (after one last sample) and returns the peaks.
    pub fn finish(mut self) -> RssPeaks {
        self.stop.store(true, Ordering::Release);
        self.handle.take().and_then(|h| h.join().ok()).unwrap_or_default()
    }
}

impl Drop for RssSampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_status() {
        let t =
            "Name:\tx\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\nRssAnon:\t 512 kB\nRssFile:\t 500 kB\nRssShmem:\t 12 kB\n";
        let s = ProcStatus::parse(t);
        assert_eq!(
            s,
            ProcStatus {
                vm_rss: 1024 * 1024,
                vm_hwm: 2048 * 1024,
                rss_anon: 512 * 1024,
                rss_file: 500 * 1024,
                rss_shmem: 12 * 1024
            }
        );
        assert_eq!(ProcStatus::parse("garbage"), ProcStatus::default());
    }

    #[test]
    fn the_sampler_sees_a_buffer_come_and_go() {
        let Some(sampler) = RssSampler::start(Duration::from_millis(1)) else {
            eprintln!("skipped: no /proc/self/status here");
            return;
        };
        let mut v = vec![0u8; 64 << 20];
        // Touch every page so it is resident, hold it for a while, then free it.
        for i in (0..v.len()).step_by(4096) {
            v[i] = 1;
        }
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(v.iter().step_by(4096).map(|&b| b as usize).sum::<usize>(), v.len() / 4096);
        drop(v);
        let p = sampler.finish();
        assert!(p.samples >= 2, "{p:?}");
        // Other tests run in parallel in this process, so only a lower bound is certain.
        assert!(p.anon_growth() >= 60 << 20, "peak anonymous growth {} for a 64 MiB buffer: {p:?}", p.anon_growth());
        assert!(p.rss >= p.start.vm_rss + (60 << 20), "{p:?}");
    }
}
