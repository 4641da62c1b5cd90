//! GPU time per kernel from timestamp queries (`TM_WGPU_PROFILE=1`, [`WgpuOptions::profile`]).
//!
//! Every launch's compute pass writes a timestamp at its start and end into a query set; when
//! the recorded work is submitted, the timestamps are resolved, read back (the host waits for
//! the GPU: profiling serialises the host and the device) and added to per-kernel totals. Next
//! to them: each submission's GPU span (first pass start to last pass end, so the span minus the
//! kernels' sum is the time between passes) and the host time spent recording it (first launch
//! to submission; pipelines are compiled on first use, so the first steps include that). [`Gpu::profile`](crate::Gpu::profile) returns the totals; the report is
//! printed to stderr when the device is dropped.
//!
//! [`WgpuOptions::profile`]: crate::WgpuOptions::profile

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Launches timed per submission at most (two queries each); the recorder submits when full.
pub(crate) const MAX_TIMED_LAUNCHES: u32 = 2048;

/// One kernel's totals.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct KernelTime {
    /// Launches timed.
    pub launches: u64,
    /// GPU time summed over them, in nanoseconds.
    pub ns: f64,
}

/// What the profiler measured so far.
#[derive(Clone, Debug, Default)]
pub struct ProfileStats {
    /// Totals per kernel name.
    pub kernels: BTreeMap<&'static str, KernelTime>,
    /// Submissions that held timed launches.
    pub submissions: u64,
    /// Sum over those submissions of the first pass start to the last pass end, in nanoseconds.
    pub gpu_span_ns: f64,
    /// Host time from the first launch of a submission to the submission, summed.
    pub host_record: Duration,
}

impl ProfileStats {
    /// GPU time of all kernels, in nanoseconds.
    pub fn kernel_ns(&self) -> f64 {
        self.kernels.values().map(|k| k.ns).sum()
    }

    /// The totals as a table, kernels by descending time.
    pub fn report(&self) -> String {
        let total = self.kernel_ns();
        let mut rows: Vec<_> = self.kernels.iter().collect();
        rows.sort_by(|a, b| b.1.ns.total_cmp(&a.1.ns));
        let mut s = format!(
            "wgpu profile: {} submissions; GPU span {:.3} ms, kernels {:.3} ms ({:.3} ms between passes); \
             host recording {:.3} ms\n{:<28} {:>9} {:>12} {:>10} {:>7}\n",
            self.submissions,
            self.gpu_span_ns / 1e6,
            total / 1e6,
            (self.gpu_span_ns - total).max(0.0) / 1e6,
            self.host_record.as_secs_f64() * 1e3,
            "kernel",
            "launches",
            "total ms",
            "mean us",
            "share",
        );
        for (name, k) in rows {
            s.push_str(&format!(
                "{:<28} {:>9} {:>12.3} {:>10.2} {:>6.1}%\n",
                name,
                k.launches,
                k.ns / 1e6,
                k.ns / 1e3 / k.launches.max(1) as f64,
                if total > 0.0 { 100.0 * k.ns / total } else { 0.0 }
            ));
        }
        s
    }
}

/// The query set, its resolve and readback buffers, and the launches of the pending submission.
#[derive(Debug)]
pub(crate) struct Profiler {
    set: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    readback: wgpu::Buffer,
    period_ns: f64,
    pending: Vec<&'static str>,
    record_start: Option<Instant>,
    stats: ProfileStats,
}

impl Profiler {
    /// A profiler on `device` (opened with `Features::TIMESTAMP_QUERY`).
    pub(crate) fn new(device: &wgpu::Device, queue: &wgpu::Queue) -> Profiler {
        let bytes = u64::from(2 * MAX_TIMED_LAUNCHES) * 8;
        let buffer = |label, usage| {
            device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: bytes,
                usage,
                mapped_at_creation: false,
            })
        };
        Profiler {
            set: device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("tm profile"),
                ty: wgpu::QueryType::Timestamp,
                count: 2 * MAX_TIMED_LAUNCHES,
            }),
            resolve: buffer("profile resolve", wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC),
            readback: buffer("profile readback", wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST),
            period_ns: f64::from(queue.get_timestamp_period()),
            pending: Vec::new(),
            record_start: None,
            stats: ProfileStats::default(),
        }
    }

    /// Whether the pending submission has no room for another timed launch.
    pub(crate) fn full(&self) -> bool {
        self.pending.len() as u32 >= MAX_TIMED_LAUNCHES
    }

    /// Notes that a launch is being recorded (starts the host clock of a new submission).
    pub(crate) fn recording(&mut self) {
        self.record_start.get_or_insert_with(Instant::now);
    }

    /// The query set and the first of the two query indices for launch `name` (the caller has
    /// checked [`Profiler::full`]).
    pub(crate) fn next(&mut self, name: &'static str) -> (wgpu::QuerySet, u32) {
        self.pending.push(name);
        (self.set.clone(), 2 * (self.pending.len() as u32 - 1))
    }

    /// Records the resolve of the pending launches' timestamps into `enc` (before it is
    /// finished); stops the host clock.
    pub(crate) fn resolve(&mut self, enc: &mut wgpu::CommandEncoder) {
        if let Some(t) = self.record_start.take() {
            self.stats.host_record += t.elapsed();
        }
        let n = 2 * self.pending.len() as u32;
        if n > 0 {
            enc.resolve_query_set(&self.set, 0..n, &self.resolve, 0);
            enc.copy_buffer_to_buffer(&self.resolve, 0, &self.readback, 0, u64::from(n) * 8);
        }
    }

    /// After the submission: waits for it, reads the timestamps back and adds them up.
    pub(crate) fn collect(&mut self, device: &wgpu::Device) {
        let names = std::mem::take(&mut self.pending);
        if names.is_empty() {
            return;
        }
        let bytes = names.len() as u64 * 16;
        let (tx, rx) = std::sync::mpsc::channel();
        self.readback.slice(..bytes).map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        if let Err(e) = device.poll(wgpu::PollType::wait_indefinitely()) {
            tracing::warn!("wgpu profile: waiting for the device: {e}");
            return;
        }
        if !matches!(rx.recv(), Ok(Ok(()))) {
            tracing::warn!("wgpu profile: the timestamps could not be read back");
            return;
        }
        let ticks: Vec<u64> = match self.readback.slice(..bytes).get_mapped_range() {
            Ok(view) => bytemuck::pod_collect_to_vec(&view[..]),
            Err(e) => {
                tracing::warn!("wgpu profile: reading the timestamps: {e}");
                self.readback.unmap();
                return;
            }
        };
        self.readback.unmap();
        let (mut first, mut last) = (u64::MAX, 0u64);
        for (name, pair) in names.iter().zip(ticks.chunks_exact(2)) {
            let k = self.stats.kernels.entry(name).or_default();
            k.launches += 1;
            k.ns += pair[1].saturating_sub(pair[0]) as f64 * self.period_ns;
            first = first.min(pair[0]);
            last = last.max(pair[1]);
        }
        self.stats.submissions += 1;
        self.stats.gpu_span_ns += last.saturating_sub(first) as f64 * self.period_ns;
    }

    /// The totals so far.
    pub(crate) fn stats(&self) -> &ProfileStats {
        &self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_orders_kernels_by_time_and_sums_them() {
        let mut s = ProfileStats { submissions: 2, gpu_span_ns: 5e6, ..Default::default() };
        s.kernels.insert("rms_norm", KernelTime { launches: 4, ns: 1e6 });
        s.kernels.insert("gemv_vec_f16_sg", KernelTime { launches: 8, ns: 3e6 });
        assert_eq!(s.kernel_ns(), 4e6);
        let r = s.report();
        let gemv = r.find("gemv_vec_f16_sg").unwrap();
        let norm = r.find("rms_norm").unwrap();
        assert!(gemv < norm, "{r}");
        assert!(r.contains("kernels 4.000 ms (1.000 ms between passes)"), "{r}");
        assert!(r.contains("375.00"), "mean of the gemv launches in us: {r}");
        assert!(r.contains("75.0%"), "{r}");
    }
}
