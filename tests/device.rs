//! Device memory as load targets and save sources, on the simulated device (host memory
//! posing as a GPU, with copies deferred until their fence is waited on, so that a staging
//! buffer reused too early shows up as wrong bytes). tests/gpu.rs runs the same on CUDA.

use std::sync::Arc;
use std::time::Duration;

use zarrckpt::comm::run_local;
use zarrckpt::device::{
    DevicePiece, DeviceStaging, DeviceTarget, DeviceView, SimDevice, load_to_device,
};
use zarrckpt::{
    Communicator, DType, Error, LoadOptions, LoadTarget, Region, SaveOptions, SaveRequest, Saver,
    SaverOptions, ShardedTensor, StrictMode, TensorKey, load, save,
};

/// A tensor's full contents: element i holds the low bytes of `i * 2654435761 ^ seed`.
fn global(shape: &[u64], elem: usize, seed: u32) -> Vec<u8> {
    let n: u64 = shape.iter().product();
    let mut out = Vec::with_capacity(n as usize * elem);
    for i in 0..n {
        let v = (i as u32).wrapping_mul(2_654_435_761) ^ seed;
        out.extend_from_slice(&v.to_le_bytes()[..elem.min(4)]);
        out.extend(std::iter::repeat_n(0u8, elem.saturating_sub(4)));
    }
    out
}

/// The bytes of `region` of a C-order tensor, in C order.
fn cut(full: &[u8], shape: &[u64], region: &Region, elem: usize) -> Vec<u8> {
    let mut out = Vec::new();
    let n: u64 = region.shape().iter().product();
    let mut idx = vec![0u64; shape.len()];
    for _ in 0..n {
        let lin = idx
            .iter()
            .zip(region.offset())
            .zip(shape)
            .fold(0u64, |acc, ((i, o), s)| acc * s + i + o);
        let at = lin as usize * elem;
        out.extend_from_slice(&full[at..at + elem]);
        for a in (0..idx.len()).rev() {
            idx[a] += 1;
            if idx[a] < region.shape()[a] {
                break;
            }
            idx[a] = 0;
        }
    }
    out
}

/// Scatters C-order `bytes` of a box into a strided device image (a host copy of device
/// memory at `base`), as a device view with `strides` would place them.
fn scatter(
    image: &mut [u8],
    base: usize,
    shape: &[u64],
    strides: &[u64],
    elem: usize,
    bytes: &[u8],
) {
    let n: u64 = shape.iter().product();
    let mut idx = vec![0u64; shape.len()];
    for k in 0..n as usize {
        let off: u64 = idx.iter().zip(strides).map(|(i, s)| i * s).sum();
        let at = base + off as usize * elem;
        image[at..at + elem].copy_from_slice(&bytes[k * elem..(k + 1) * elem]);
        for a in (0..idx.len()).rev() {
            idx[a] += 1;
            if idx[a] < shape[a] {
                break;
            }
            idx[a] = 0;
        }
    }
}

struct T {
    key: &'static str,
    dtype: DType,
    shape: Vec<u64>,
    seed: u32,
}

fn tensors() -> Vec<T> {
    vec![
        T {
            key: "w.f32",
            dtype: DType::Float32,
            shape: vec![37, 23],
            seed: 1,
        },
        T {
            key: "w.bf16",
            dtype: DType::BFloat16,
            shape: vec![5, 9, 11],
            seed: 2,
        },
        T {
            key: "b.i64",
            dtype: DType::Int64,
            shape: vec![41],
            seed: 3,
        },
    ]
}

/// Rows `[r*n/w, (r+1)*n/w)` of axis `axis`.
fn split(shape: &[u64], axis: usize, r: usize, w: usize) -> Region {
    let n = shape[axis];
    let lo = n * r as u64 / w as u64;
    let hi = n * (r as u64 + 1) / w as u64;
    let mut offset = vec![0; shape.len()];
    let mut s = shape.to_vec();
    offset[axis] = lo;
    s[axis] = hi - lo;
    Region::new(offset, s).unwrap()
}

/// Saves the tensors from host memory with `world` ranks, each holding a row split.
fn save_host(dir: &std::path::Path, world: usize) {
    let ts = tensors();
    let fulls: Vec<Vec<u8>> = ts
        .iter()
        .map(|t| global(&t.shape, t.dtype.size(), t.seed))
        .collect();
    let results = run_local(world, Duration::from_secs(30), |comm| {
        let r = comm.rank();
        let bufs: Vec<(Region, Vec<u8>)> = ts
            .iter()
            .zip(&fulls)
            .map(|(t, f)| {
                let reg = split(&t.shape, 0, r, world);
                let b = cut(f, &t.shape, &reg, t.dtype.size());
                (reg, b)
            })
            .collect();
        let pieces: Vec<ShardedTensor<'_>> = ts
            .iter()
            .zip(&bufs)
            .map(|(t, (reg, b))| {
                ShardedTensor::new(
                    TensorKey::new(t.key).unwrap(),
                    t.dtype,
                    t.shape.clone(),
                    reg.clone(),
                    0,
                    b,
                )
                .unwrap()
            })
            .collect();
        save(&pieces, dir, &comm, &SaveOptions::default()).map(|_| ())
    });
    for r in results {
        r.unwrap();
    }
}

/// Each of `world` ranks loads a column split (the last axis) of every tensor into a
/// strided window of a larger device buffer (padding on every axis, so the window is a
/// column strip), through staging of `cap` bytes; checks the device bytes.
fn load_strips(dir: &std::path::Path, world: usize, cap: usize, transpose: bool) {
    let ts = tensors();
    let fulls: Vec<Vec<u8>> = ts
        .iter()
        .map(|t| global(&t.shape, t.dtype.size(), t.seed))
        .collect();
    let results = run_local(world, Duration::from_secs(30), |comm| {
        let dev = Arc::new(SimDevice::new());
        let mut staging = DeviceStaging::new(dev.clone(), cap);
        let r = comm.rank();
        let mut checks = Vec::new();
        let mut targets = Vec::new();
        for (t, f) in ts.iter().zip(&fulls) {
            let elem = t.dtype.size();
            let last = t.shape.len() - 1;
            let reg = split(&t.shape, last, r, world);
            // The enclosing device buffer: the box plus 2 on every axis, C order, or with
            // the two last axes swapped (a transposed view).
            let mut outer: Vec<u64> = reg.shape().iter().map(|s| s + 2).collect();
            let mut strides = vec![1u64; outer.len()];
            if transpose && outer.len() >= 2 {
                let n = outer.len();
                outer.swap(n - 1, n - 2);
                let mut cs = vec![1u64; n];
                for d in (0..n - 1).rev() {
                    cs[d] = cs[d + 1] * outer[d + 1];
                }
                strides = cs.clone();
                strides.swap(n - 1, n - 2);
            } else {
                for d in (0..outer.len().saturating_sub(1)).rev() {
                    strides[d] = strides[d + 1] * outer[d + 1];
                }
            }
            let len = outer.iter().product::<u64>() as usize * elem;
            let base = dev.alloc(len);
            // The window starts at index (1, 1, ...) of the enclosing buffer.
            let start: u64 = strides.iter().sum::<u64>() * elem as u64;
            let view = unsafe { DeviceView::new(base + start, strides.clone()) };
            targets.push(
                DeviceTarget::new(
                    TensorKey::new(t.key).unwrap(),
                    t.dtype,
                    t.shape.clone(),
                    reg.clone(),
                    view,
                )
                .unwrap(),
            );
            let mut want = vec![0u8; len];
            scatter(
                &mut want,
                start as usize,
                reg.shape(),
                &strides,
                elem,
                &cut(f, &t.shape, &reg, elem),
            );
            checks.push((base, want));
        }
        let rep = load_to_device(
            &mut [],
            &targets,
            &mut staging,
            dir,
            &comm,
            &LoadOptions::default(),
        )?;
        for (base, want) in &checks {
            let got = dev.read(*base, want.len()).unwrap();
            assert!(got == *want, "rank {r}: device bytes differ");
        }
        assert!(
            dev.pinned_peak() <= cap.max(32),
            "pinned peak {} over cap {cap}",
            dev.pinned_peak()
        );
        // A second load through the same staging allocates no more pinned memory.
        let before = dev.pinned_allocations();
        load_to_device(
            &mut [],
            &targets,
            &mut staging,
            dir,
            &comm,
            &LoadOptions::default(),
        )?;
        assert_eq!(dev.pinned_allocations(), before);
        Ok::<_, Error>(rep)
    });
    let reports: Vec<_> = results.into_iter().map(Result::unwrap).collect();
    let rounds = reports[0].rounds;
    assert!(
        reports.iter().all(|r| r.rounds == rounds),
        "ranks ran different round counts"
    );
    let loaded: u64 = reports.iter().map(|r| r.device_bytes).sum();
    let total: u64 = tensors()
        .iter()
        .map(|t| t.shape.iter().product::<u64>() * t.dtype.size() as u64)
        .sum();
    assert_eq!(loaded, total);
}

#[test]
fn loads_column_strips_into_strided_device_views_in_bounded_rounds() {
    let tmp = tempfile::tempdir().unwrap();
    // In a folder of its own: the lock file beside it goes with the temporary folder.
    let dir = tmp.path().join("ckpt");
    save_host(&dir, 2);
    // A cap far below every tensor: many rounds, tensors cut into slabs.
    load_strips(&dir, 3, 256, false);
    // A cap above everything: one round.
    load_strips(&dir, 3, 1 << 20, false);
    // Transposed device layout (2-D / 3-D pitched copies with permuted strides).
    load_strips(&dir, 2, 512, true);
}

#[test]
fn host_and_device_targets_load_in_one_call() {
    let tmp = tempfile::tempdir().unwrap();
    // In a folder of its own: the lock file beside it goes with the temporary folder.
    let dir = tmp.path().join("ckpt");
    save_host(&dir, 2);
    let ts = tensors();
    let results = run_local(2, Duration::from_secs(30), |comm| {
        let dev = Arc::new(SimDevice::new());
        let mut staging = DeviceStaging::new(dev.clone(), 128);
        let t0 = &ts[0];
        let t2 = &ts[2];
        let region = Region::new(vec![0, 0], t0.shape.clone()).unwrap();
        let len = (t0.shape.iter().product::<u64>() as usize) * 4;
        let base = dev.alloc(len);
        let view = unsafe { DeviceView::contiguous(base, &t0.shape) };
        let dt = DeviceTarget::new(
            TensorKey::new(t0.key).unwrap(),
            t0.dtype,
            t0.shape.clone(),
            region,
            view,
        )
        .unwrap();
        let mut host = vec![0u8; 41 * 8];
        let mut ht = [LoadTarget::new(
            TensorKey::new(t2.key).unwrap(),
            t2.dtype,
            t2.shape.clone(),
            Region::new(vec![0], vec![41]).unwrap(),
            &mut host,
        )
        .unwrap()];
        let rep = load_to_device(
            &mut ht,
            &[dt],
            &mut staging,
            dir_path(&comm, &dir),
            &comm,
            &LoadOptions::default(),
        )
        .unwrap();
        assert!(rep.rounds > 1);
        assert_eq!(host, global(&t2.shape, 8, t2.seed));
        assert_eq!(dev.read(base, len).unwrap(), global(&t0.shape, 4, t0.seed));
    });
    assert_eq!(results.len(), 2);
}

/// A rank with device targets loads in several rounds; a rank with host targets only keeps
/// step with it (no staging buffers of its own): both load, neither indexes a buffer it
/// does not have.
#[test]
fn a_rank_without_device_targets_keeps_step_with_one_that_has_them() {
    let tmp = tempfile::tempdir().unwrap();
    // In a folder of its own: the lock file beside it goes with the temporary folder.
    let dir = tmp.path().join("ckpt");
    save_host(&dir, 2);
    let ts = tensors();
    let results = run_local(2, Duration::from_secs(30), |comm| {
        let dev = Arc::new(SimDevice::new());
        let mut staging = DeviceStaging::new(dev.clone(), 128);
        let (t0, t2) = (&ts[0], &ts[2]);
        let len = (t0.shape.iter().product::<u64>() as usize) * 4;
        let base = dev.alloc(len);
        let device: Vec<DeviceTarget> = if comm.rank() == 0 {
            let view = unsafe { DeviceView::contiguous(base, &t0.shape) };
            vec![
                DeviceTarget::new(
                    TensorKey::new(t0.key).unwrap(),
                    t0.dtype,
                    t0.shape.clone(),
                    Region::new(vec![0, 0], t0.shape.clone()).unwrap(),
                    view,
                )
                .unwrap(),
            ]
        } else {
            Vec::new()
        };
        let mut host = vec![0u8; 41 * 8];
        let mut ht = [LoadTarget::new(
            TensorKey::new(t2.key).unwrap(),
            t2.dtype,
            t2.shape.clone(),
            Region::new(vec![0], vec![41]).unwrap(),
            &mut host,
        )
        .unwrap()];
        let rep = load_to_device(
            &mut ht,
            &device,
            &mut staging,
            dir_path(&comm, &dir),
            &comm,
            &LoadOptions::default(),
        )
        .unwrap();
        assert!(
            rep.rounds > 1,
            "rank 0's device target takes several rounds"
        );
        assert_eq!(host, global(&t2.shape, 8, t2.seed));
        if comm.rank() == 0 {
            assert_eq!(dev.read(base, len).unwrap(), global(&t0.shape, 4, t0.seed));
        }
    });
    assert_eq!(results.len(), 2);
}

fn dir_path<'a>(_comm: &dyn Communicator, p: &'a std::path::Path) -> &'a std::path::Path {
    p
}

#[test]
fn bad_device_requests_fail_on_every_rank() {
    let tmp = tempfile::tempdir().unwrap();
    // In a folder of its own: the lock file beside it goes with the temporary folder.
    let dir = tmp.path().join("ckpt");
    save_host(&dir, 1);
    // A key the checkpoint lacks, on one rank only: every rank fails, naming it.
    let results = run_local(2, Duration::from_secs(30), |comm| {
        let dev = Arc::new(SimDevice::new());
        let mut staging = DeviceStaging::new(dev.clone(), 1024);
        let key = if comm.rank() == 1 { "nope" } else { "b.i64" };
        let base = dev.alloc(41 * 8);
        let view = unsafe { DeviceView::contiguous(base, &[41]) };
        let t = DeviceTarget::new(
            TensorKey::new(key).unwrap(),
            DType::Int64,
            vec![41],
            Region::new(vec![0], vec![41]).unwrap(),
            view,
        )
        .unwrap();
        load_to_device(
            &mut [],
            &[t],
            &mut staging,
            &dir,
            &comm,
            &LoadOptions::default(),
        )
        .map(|_| ())
    });
    for r in results {
        let e = r.unwrap_err();
        assert!(e.to_string().contains("nope"), "{e}");
    }
    // A wrong data type.
    let results = run_local(1, Duration::from_secs(30), |comm| {
        let dev = Arc::new(SimDevice::new());
        let mut staging = DeviceStaging::new(dev.clone(), 1024);
        let base = dev.alloc(41 * 4);
        let view = unsafe { DeviceView::contiguous(base, &[41]) };
        let t = DeviceTarget::new(
            TensorKey::new("b.i64").unwrap(),
            DType::Float32,
            vec![41],
            Region::new(vec![0], vec![41]).unwrap(),
            view,
        )
        .unwrap();
        load_to_device(
            &mut [],
            &[t],
            &mut staging,
            &dir,
            &comm,
            &LoadOptions::default(),
        )
        .map(|_| ())
    });
    assert!(
        matches!(results[0], Err(Error::DtypeMismatch { .. })),
        "{:?}",
        results[0]
    );
    // With a strict mode that skips unknown keys, the rest still loads.
    let results = run_local(1, Duration::from_secs(30), |comm| {
        let dev = Arc::new(SimDevice::new());
        let mut staging = DeviceStaging::new(dev.clone(), 64);
        let a = dev.alloc(41 * 8);
        let b = dev.alloc(41 * 8);
        let mk = |key: &str, at| {
            DeviceTarget::new(
                TensorKey::new(key).unwrap(),
                DType::Int64,
                vec![41],
                Region::new(vec![0], vec![41]).unwrap(),
                unsafe { DeviceView::contiguous(at, &[41]) },
            )
            .unwrap()
        };
        let opts = LoadOptions {
            strict: StrictMode::ReturnUnexpected,
            ..LoadOptions::default()
        };
        let rep = load_to_device(
            &mut [],
            &[mk("nope", a), mk("b.i64", b)],
            &mut staging,
            &dir,
            &comm,
            &opts,
        )
        .unwrap();
        assert_eq!(rep.load.unexpected, vec![TensorKey::new("nope").unwrap()]);
        assert_eq!(dev.read(b, 41 * 8).unwrap(), global(&[41], 8, 3));
        assert_eq!(dev.read(a, 41 * 8).unwrap(), vec![0u8; 41 * 8]);
    });
    assert_eq!(results.len(), 1);
    // An overlapping view is refused before anything runs.
    let e = DeviceTarget::new(
        TensorKey::new("w.f32").unwrap(),
        DType::Float32,
        vec![37, 23],
        Region::new(vec![0, 0], vec![37, 23]).unwrap(),
        unsafe { DeviceView::new(0x1000, vec![1, 1]) },
    )
    .unwrap_err();
    assert!(
        e.to_string().contains("overlaps") && e.to_string().contains("w.f32"),
        "{e}"
    );
}

/// Saves from device memory (pieces as column strips of padded device buffers, which the
/// chunk grid does not follow: parts travel between ranks and chunks are assembled) with 2
/// ranks through a `Saver`, synchronously or asynchronously, with a staging cap small enough
/// for several rounds; loads on the host and compares.
fn save_from_device(asynchronous: bool) {
    let dir = tempfile::tempdir().unwrap();
    let ts = tensors();
    let fulls: Vec<Vec<u8>> = ts
        .iter()
        .map(|t| global(&t.shape, t.dtype.size(), t.seed))
        .collect();
    let world = 2;
    let results = run_local(world, Duration::from_secs(30), |comm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let dev = Arc::new(SimDevice::new());
        let staging = SaverOptions {
            staging_bytes: 2048,
            ..SaverOptions::default()
        };
        let mut saver = Saver::with_options(Arc::clone(&comm), staging);
        let r = comm.rank();
        let mut pieces = Vec::new();
        let mut buffers = Vec::new();
        for (t, f) in ts.iter().zip(&fulls) {
            let elem = t.dtype.size();
            let last = t.shape.len() - 1;
            let reg = split(&t.shape, last, r, world);
            let outer: Vec<u64> = reg.shape().iter().map(|s| s + 1).collect();
            let mut strides = vec![1u64; outer.len()];
            for d in (0..outer.len() - 1).rev() {
                strides[d] = strides[d + 1] * outer[d + 1];
            }
            let len = outer.iter().product::<u64>() as usize * elem;
            let base = dev.alloc(len);
            let mut image = vec![0xEEu8; len];
            scatter(
                &mut image,
                0,
                reg.shape(),
                &strides,
                elem,
                &cut(f, &t.shape, &reg, elem),
            );
            dev.write(base, &image).unwrap();
            buffers.push((base, len));
            let view = unsafe { DeviceView::new(base, strides) };
            pieces.push(
                DevicePiece::new(
                    TensorKey::new(t.key).unwrap(),
                    t.dtype,
                    t.shape.clone(),
                    reg,
                    0,
                    view,
                )
                .unwrap(),
            );
        }
        let opts = SaveOptions::default();
        let request = SaveRequest::new().with_device_tensors(dev.clone(), pieces.clone());
        let mut written = 0;
        let mut pinned = 0;
        for round in 0..2 {
            let path = dir.path().join(format!("step{round}"));
            if asynchronous {
                let h = saver.save_async(&request, &path, &opts)?;
                // The caller may change device memory as soon as the call returns.
                for (base, len) in &buffers {
                    dev.write(*base, &vec![0x55u8; *len]).unwrap();
                }
                written = h.wait()?.data_bytes;
                // Put the data back for the next round.
                for ((base, _), (t, f)) in buffers.iter().zip(ts.iter().zip(&fulls)) {
                    let elem = t.dtype.size();
                    let reg = split(&t.shape, t.shape.len() - 1, r, world);
                    let outer: Vec<u64> = reg.shape().iter().map(|s| s + 1).collect();
                    let mut strides = vec![1u64; outer.len()];
                    for d in (0..outer.len() - 1).rev() {
                        strides[d] = strides[d + 1] * outer[d + 1];
                    }
                    let mut image = vec![0xEEu8; outer.iter().product::<u64>() as usize * elem];
                    scatter(
                        &mut image,
                        0,
                        reg.shape(),
                        &strides,
                        elem,
                        &cut(f, &t.shape, &reg, elem),
                    );
                    dev.write(*base, &image).unwrap();
                }
            } else {
                written = saver.save(&request, &path, &opts)?.data_bytes;
            }
            // Staging is reused: no page-locked allocation after the first save.
            if round == 0 {
                pinned = dev.pinned_allocations();
                assert!(pinned > 0);
            }
            assert_eq!(dev.pinned_allocations(), pinned, "round {round}");
        }
        Ok::<_, Error>(written)
    });
    // Every element was written once, by one rank.
    let written: u64 = results.into_iter().map(Result::unwrap).sum();
    let total: u64 = (0..world).map(|r| pieces_bytes(&ts, r, world) as u64).sum();
    assert_eq!(written, total);
    // Load each step on the host, whole, and compare.
    for round in 0..2 {
        let path = dir.path().join(format!("step{round}"));
        let results = run_local(1, Duration::from_secs(30), |comm| {
            let mut bufs: Vec<Vec<u8>> = ts
                .iter()
                .map(|t| vec![0u8; t.shape.iter().product::<u64>() as usize * t.dtype.size()])
                .collect();
            let mut targets: Vec<LoadTarget<'_>> = ts
                .iter()
                .zip(bufs.iter_mut())
                .map(|(t, b)| {
                    LoadTarget::new(
                        TensorKey::new(t.key).unwrap(),
                        t.dtype,
                        t.shape.clone(),
                        Region::new(vec![0; t.shape.len()], t.shape.clone()).unwrap(),
                        b,
                    )
                    .unwrap()
                })
                .collect();
            load(&mut targets, &path, &comm, &LoadOptions::default()).unwrap();
            drop(targets);
            bufs
        });
        for (got, want) in results[0].iter().zip(&fulls) {
            assert!(got == want, "saved bytes differ");
        }
    }
}

fn pieces_bytes(ts: &[T], r: usize, world: usize) -> usize {
    ts.iter()
        .map(|t| {
            split(&t.shape, t.shape.len() - 1, r, world)
                .shape()
                .iter()
                .product::<u64>() as usize
                * t.dtype.size()
        })
        .sum()
}

#[test]
fn saves_strided_device_pieces() {
    save_from_device(false);
}

#[test]
fn async_save_from_device_snapshots_before_returning() {
    save_from_device(true);
}

/// One rank holds its rows of a tensor in device memory, the other in host memory: both save
/// through the same `Saver` calls (synchronous and asynchronous) and the tensor reads back
/// whole. A layout error among device pieces (an overlap) is returned by the call itself, on
/// every rank, before anything is staged or written.
#[test]
fn ranks_with_and_without_device_pieces_save_together() {
    let dir = tempfile::tempdir().unwrap();
    let shape = [8u64, 6];
    let full = global(&shape, 4, 9);
    let results = run_local(2, Duration::from_secs(30), |comm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let r = comm.rank();
        let dev = Arc::new(SimDevice::new());
        let mut saver = Saver::new(Arc::clone(&comm));
        let rows = split(&shape, 0, r, 2);
        let mine = cut(&full, &shape, &rows, 4);
        let key = TensorKey::new("w").unwrap();
        let request = if r == 0 {
            let base = dev.alloc(mine.len());
            dev.write(base, &mine).unwrap();
            let view = unsafe { DeviceView::contiguous(base, rows.shape()) };
            let p = DevicePiece::new(key.clone(), DType::Float32, shape.to_vec(), rows, 0, view)
                .unwrap();
            SaveRequest::new().with_device_tensors(dev.clone(), [p])
        } else {
            let p = ShardedTensor::new(key.clone(), DType::Float32, shape.to_vec(), rows, 0, &mine)
                .unwrap();
            SaveRequest::new().with_tensors([p])
        };
        let opts = SaveOptions::default();
        saver.save(&request, &dir.path().join("sync"), &opts)?;
        saver
            .save_async(&request, &dir.path().join("async"), &opts)?
            .wait()?;
        // Rank 1 also claims rank 0's rows, as a device piece: an overlap.
        let base = dev.alloc(full.len());
        dev.write(base, &full).unwrap();
        let all = Region::full(&shape);
        let view = unsafe { DeviceView::contiguous(base, &shape) };
        let bad = if r == 1 {
            let p = DevicePiece::new(key, DType::Float32, shape.to_vec(), all, 0, view).unwrap();
            SaveRequest::new().with_device_tensors(dev.clone(), [p])
        } else {
            request
        };
        let e = saver
            .save_async(&bad, &dir.path().join("bad"), &opts)
            .map(|_| ())
            .unwrap_err();
        assert!(matches!(e, Error::Plan(_)), "rank {r}: {e}");
        Ok::<_, Error>(())
    });
    for r in results {
        r.unwrap();
    }
    for sub in ["sync", "async"] {
        let ck = zarrckpt::Checkpoint::open(dir.path().join(sub)).unwrap();
        let mut got = vec![0u8; full.len()];
        ck.read_region(
            &TensorKey::new("w").unwrap(),
            &Region::full(&shape),
            &mut got,
        )
        .unwrap();
        assert!(got == full, "{sub}");
    }
    assert!(!dir.path().join("bad").join("zarr.json").exists());
}
