//! tm-core's in-process communicator on host tensors: the collectives' results, and that no
//! rank ever waits past its deadline (timeouts name the missing rank; an abort or a misused
//! collective fails every rank at once).

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};
use tm_core::{Allocator, Comm, DType, Error, LocalComm, Tensor, TensorDesc};
use tm_cpu::CpuAllocator;

const LONG: Duration = Duration::from_secs(10);

fn alloc() -> Arc<dyn Allocator> {
    Arc::new(CpuAllocator::new())
}

fn tensor(a: &Arc<dyn Allocator>, shape: &[usize], values: &[f32]) -> Tensor {
    let mut t = Tensor::zeros(a, TensorDesc::new(DType::F32, shape), "test").unwrap();
    t.host_mut::<f32>().unwrap().copy_from_slice(values);
    t
}

/// Runs `f(comm)` on one thread per rank and returns the results in rank order.
fn on_ranks<T: Send + 'static>(comms: Vec<LocalComm>, f: impl Fn(LocalComm) -> T + Send + Sync + 'static) -> Vec<T> {
    let f = Arc::new(f);
    let handles: Vec<_> = comms
        .into_iter()
        .map(|c| {
            let f = Arc::clone(&f);
            thread::spawn(move || f(c))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn collectives_compute_the_right_thing() {
    let out = on_ranks(LocalComm::group(3), |c| {
        let a = alloc();
        let r = c.rank() as f32;
        // all_reduce, several rounds in a row
        let mut t = tensor(&a, &[2, 2], &[r, 1.0, 10.0 * r, -r]);
        c.all_reduce_sum(&mut t, "sum 1", LONG).unwrap();
        c.all_reduce_sum(&mut t, "sum 2", LONG).unwrap();
        let sum = t.host::<f32>().unwrap().to_vec();
        // all_gather along the outermost dimension
        let mine = tensor(&a, &[1, 2], &[r, r + 0.5]);
        let mut all = tensor(&a, &[3, 2], &[0.0; 6]);
        c.all_gather(&mine, &mut all, "gather", LONG).unwrap();
        // broadcast from rank 2
        let mut b = tensor(&a, &[3], &[r; 3]);
        c.broadcast(&mut b, 2, "bcast", LONG).unwrap();
        c.barrier("end", LONG).unwrap();
        (sum, all.host::<f32>().unwrap().to_vec(), b.host::<f32>().unwrap().to_vec(), c.collectives_started())
    });
    for (sum, all, b, n) in out {
        assert_eq!(sum, [9.0, 9.0, 90.0, -9.0]);
        assert_eq!(all, [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]);
        assert_eq!(b, [2.0; 3]);
        assert_eq!(n, 5);
    }
}

#[test]
fn half_precision_sums_are_identical_on_every_rank() {
    let out = on_ranks(LocalComm::group(4), |c| {
        let a = alloc();
        let mut t = Tensor::zeros(&a, TensorDesc::new(DType::BF16, &[3]), "test").unwrap();
        let v: Vec<half::bf16> = (0..3).map(|i| half::bf16::from_f32(0.1 * (i + c.rank()) as f32)).collect();
        t.host_mut::<half::bf16>().unwrap().copy_from_slice(&v);
        c.all_reduce_sum(&mut t, "bf16", LONG).unwrap();
        t.host::<u16>().unwrap().to_vec()
    });
    assert!(out.windows(2).all(|w| w[0] == w[1]), "{out:?}");
    let first = half::bf16::from_bits(out[0][0]).to_f32();
    assert!((first - 0.6).abs() < 0.01, "{first}");
}

#[test]
fn a_timeout_names_rank_step_and_the_absent_rank() {
    let deadline = Duration::from_secs(1);
    let comms = LocalComm::group(3);
    let out = on_ranks(comms, move |c| {
        let a = alloc();
        let mut t = tensor(&a, &[1], &[1.0]);
        let t0 = Instant::now();
        if c.rank() == 2 {
            // Only one collective, then this rank goes quiet.
            c.all_reduce_sum(&mut t, "layer 0 o_proj", deadline).unwrap();
            return None;
        }
        c.all_reduce_sum(&mut t, "layer 0 o_proj", deadline).unwrap();
        let e = c.all_reduce_sum(&mut t, "layer 0 down_proj", deadline).unwrap_err();
        Some((e, t0.elapsed()))
    });
    let errors: Vec<_> = out.into_iter().flatten().collect();
    assert_eq!(errors.len(), 2);
    for (e, took) in &errors {
        assert!(*took < deadline + deadline / 10 + Duration::from_millis(50), "took {took:?}");
        let msg = e.to_string();
        assert!(matches!(e, Error::Timeout { .. }), "{msg}");
        assert!(msg.contains("all_reduce #1 (layer 0 down_proj)"), "{msg}");
        assert!(msg.contains("rank 2 did not arrive") && msg.contains("rank 2 was last in all_reduce #0"), "{msg}");
    }
}

#[test]
fn stall_hook_then_abort_frees_everyone() {
    let deadline = Duration::from_millis(200);
    let comms: Vec<LocalComm> =
        LocalComm::group(2).into_iter().map(|c| if c.rank() == 1 { c.stall_after(1) } else { c }).collect();
    let t0 = Instant::now();
    let out = on_ranks(comms, move |c| {
        let a = alloc();
        let mut t = tensor(&a, &[1], &[1.0]);
        c.all_reduce_sum(&mut t, "ok", deadline).unwrap();
        let e = c.all_reduce_sum(&mut t, "stalls", deadline).unwrap_err();
        // Everything after an abort fails at once.
        let later = Instant::now();
        let again = c.barrier("after", LONG).unwrap_err();
        assert!(later.elapsed() < Duration::from_millis(50));
        (e, again)
    });
    assert!(t0.elapsed() < deadline * 2, "took {:?}", t0.elapsed());
    assert!(matches!(out[0].0, Error::Timeout { rank: 0, .. }), "{}", out[0].0);
    assert!(matches!(out[1].0, Error::Aborted { rank: 1, .. }), "{}", out[1].0);
    assert!(out[1].0.to_string().contains("stalled by the test hook"), "{}", out[1].0);
}

#[test]
fn an_explicit_abort_fails_a_waiting_rank_at_once() {
    let comms = LocalComm::group(2);
    let t0 = Instant::now();
    let out = on_ranks(comms, |c| {
        if c.rank() == 1 {
            thread::sleep(Duration::from_millis(50));
            c.abort("rank 1 ran out of memory");
            return None;
        }
        Some(c.barrier("waiting", LONG).unwrap_err())
    });
    let e = out[0].as_ref().unwrap();
    assert!(t0.elapsed() < Duration::from_secs(2));
    assert!(matches!(e, Error::Aborted { rank: 0, .. }) && e.to_string().contains("ran out of memory"), "{e}");
}

#[test]
fn mismatched_collectives_are_an_error_not_a_hang() {
    let out = on_ranks(LocalComm::group(2), |c| {
        let a = alloc();
        let mut t = tensor(&a, &[2], &[1.0, 2.0]);
        if c.rank() == 0 {
            c.all_reduce_sum(&mut t, "layer 1 o_proj", LONG).unwrap_err()
        } else {
            let mut out = tensor(&a, &[4], &[0.0; 4]);
            c.all_gather(&t, &mut out, "lm_head", LONG).unwrap_err()
        }
    });
    for e in &out {
        let msg = e.to_string();
        assert!(msg.contains("all_reduce #0 (layer 1 o_proj)") && msg.contains("all_gather #0 (lm_head)"), "{msg}");
    }
}

#[test]
fn a_bad_shape_fails_the_group_instead_of_stranding_it() {
    let out = on_ranks(LocalComm::group(2), |c| {
        let a = alloc();
        let t = tensor(&a, &[1, 2], &[1.0, 2.0]);
        let rows = if c.rank() == 0 { 3 } else { 2 }; // rank 0's output is the wrong size
        let mut out = Tensor::zeros(&a, TensorDesc::new(DType::F32, &[rows, 2]), "test").unwrap();
        c.all_gather(&t, &mut out, "gather", LONG)
    });
    assert!(matches!(out[0], Err(Error::Shape { .. })), "{:?}", out[0]);
    assert!(matches!(out[1], Err(Error::Aborted { .. })), "{:?}", out[1]);
}
