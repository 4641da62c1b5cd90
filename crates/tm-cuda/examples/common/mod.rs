//! What the benchmark examples share: the copy bandwidth their figures are a fraction of, the
//! random stream for their inputs, and the `main` that skips cleanly without a GPU.

#![allow(dead_code)] // each example uses part of it

use std::fmt::Display;
use std::process::ExitCode;

pub use tm_core::sampling::Rng;
use tm_core::DType;
use tm_cuda::{CudaBackend, CudaOptions};

/// Device-to-device copy bandwidth of the backend's GPU, bytes/s, counting the bytes read and the
/// bytes written (as `scripts/gpu/copy_bandwidth.py` does): the roofline the examples report
/// against, measured when they start so that their fractions hold on whichever card runs them
/// (the script gave 4.28 TB/s on the H200s here, 3.02 on the H100s). One GiB copied, the mean of
/// 20 copies after warm-up (the script: 4 GiB, the median of 20).
pub fn copy_bandwidth(b: &CudaBackend) -> Result<f64, String> {
    use tm_core::{Ops, TensorDesc};
    const CHUNK: usize = 1 << 30;
    let what = |e: &dyn Display| format!("measuring the copy bandwidth (2 GiB): {e}");
    let mut t = b.zeros(TensorDesc::new(DType::U8, &[2 * CHUNK]), "copy bandwidth").map_err(|e| what(&e))?;
    let ms = time_ms(b, 20, |_| b.copy_chunks(&mut t, CHUNK, &[(0, 1)])).map_err(|e| what(&e))?;
    Ok(2.0 * CHUNK as f64 / (ms * 1e-3))
}

/// GPU 0 with activations `dtype`, no memory cap and no CUDA graphs (the examples time single
/// calls).
pub fn open_backend(dtype: DType) -> Result<CudaBackend, String> {
    let opts =
        CudaOptions { ordinal: 0, dtype, memory_cap: None, cuda_graphs: false, memory_model: Default::default() };
    CudaBackend::open(opts).map_err(|e| format!("opening the CUDA backend: {e}"))
}

/// Uniform in [-1, 1) from `rng`.
pub fn unit(rng: &mut Rng) -> f32 {
    (rng.next_f64() * 2.0 - 1.0) as f32
}

/// Parses the arguments with `parse` (exit 2 on an error), skips saying why when there is no
/// CUDA device (exit 0), else runs `bench` (exit 1 on an error).
pub fn run<O, E1: Display, E2: Display>(
    name: &str,
    parse: impl FnOnce() -> Result<O, E1>,
    bench: impl FnOnce(&O) -> Result<(), E2>,
) -> ExitCode {
    let o = match parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{name}: {e}");
            return ExitCode::from(2);
        }
    };
    match tm_cuda::probe() {
        Ok(devs) if !devs.is_empty() => {}
        Ok(_) => {
            println!("{name}: skipped: no CUDA device");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            println!("{name}: skipped: no CUDA device ({e})");
            return ExitCode::SUCCESS;
        }
    }
    match bench(&o) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{name}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Milliseconds per call of `f` (given the call's index) over `iters` calls, after 10 warm-up
/// calls, timed with CUDA events on the backend's stream.
pub fn time_ms(b: &CudaBackend, iters: usize, mut f: impl FnMut(usize) -> tm_core::Result<()>) -> Result<f64, String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    for i in 0..10 {
        f(i).map_err(|e| err(&e))?;
    }
    let stream = b.gpu().stream();
    // Timing events (cudarc's default flags disable timing).
    let timed = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let start = stream.record_event(timed).map_err(|e| err(&e))?;
    for i in 0..iters {
        f(i).map_err(|e| err(&e))?;
    }
    let end = stream.record_event(timed).map_err(|e| err(&e))?;
    end.synchronize().map_err(|e| err(&e))?;
    Ok(start.elapsed_ms(&end).map_err(|e| err(&e))? as f64 / iters as f64)
}
