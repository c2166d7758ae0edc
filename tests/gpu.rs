//! Device memory on a real GPU (cargo feature `cuda`): load into strided device views and
//! save from them, checked byte for byte. Without a CUDA driver or GPU every test says so
//! and returns (CI has none); run on a GPU machine with
//! `cargo test --release --features cuda --test gpu -- --nocapture`.
#![cfg(feature = "cuda")]

use std::sync::Arc;
use std::time::Duration;

use zarrckpt::comm::run_local;
use zarrckpt::device::{
    CudaDevice, Device, DevicePiece, DeviceStaging, DeviceTarget, DeviceView, Pitched,
    load_to_device,
};
use zarrckpt::{
    Communicator, DType, LoadOptions, LoadTarget, Region, SaveOptions, ShardedTensor, TensorKey,
    load, save,
};

fn gpu() -> Option<Arc<CudaDevice>> {
    if !CudaDevice::available() {
        eprintln!("SKIPPED: no CUDA driver or GPU on this machine");
        return None;
    }
    Some(Arc::new(CudaDevice::new(0).expect("device 0")))
}

fn linear(len: usize) -> [Pitched; 1] {
    [Pitched {
        host_offset: 0,
        host_pitch: len,
        host_slice_pitch: len,
        device: 0,
        device_pitch: len as u64,
        device_slice_pitch: len as u64,
        width: len,
        height: 1,
        depth: 1,
    }]
}

fn upload(dev: &CudaDevice, address: u64, bytes: &[u8]) {
    let mut p = dev.pinned(bytes.len()).unwrap();
    p[..bytes.len()].copy_from_slice(bytes);
    let mut c = linear(bytes.len());
    c[0].device = address;
    let f = unsafe { dev.to_device(p.as_ptr(), &c) }.unwrap();
    dev.wait(f).unwrap();
}

fn download(dev: &CudaDevice, address: u64, len: usize) -> Vec<u8> {
    let mut p = dev.pinned(len).unwrap();
    let mut c = linear(len);
    c[0].device = address;
    let f = unsafe { dev.to_host(p.as_mut_ptr(), &c) }.unwrap();
    dev.wait(f).unwrap();
    p[..len].to_vec()
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// A 2-D f32 tensor [rows, cols] saved by 2 host ranks (row halves), loaded into a column
/// strip of a padded device matrix (a 2-D pitched copy) in small staging rounds.
#[test]
fn loads_into_device_column_strips() {
    let Some(dev) = gpu() else { return };
    let tmp = tempfile::tempdir().unwrap();
    // In a folder of its own: the lock file beside it goes with the temporary folder.
    let dir = tmp.path().join("ckpt");
    let (rows, cols) = (300u64, 257u64);
    let full = pattern((rows * cols * 4) as usize, 7);
    let key = TensorKey::new("w").unwrap();
    run_local(2, Duration::from_secs(60), |comm| {
        let r = comm.rank() as u64;
        let reg = Region::new(vec![r * rows / 2, 0], vec![rows / 2, cols]).unwrap();
        let bytes =
            &full[(r * rows / 2 * cols * 4) as usize..((r + 1) * rows / 2 * cols * 4) as usize];
        let p = ShardedTensor::new(key.clone(), DType::Float32, vec![rows, cols], reg, 0, bytes)
            .unwrap();
        save(&[p], &dir, &comm, &SaveOptions::default()).unwrap();
    });
    // Columns 100..200 into a [rows, 128] device matrix at column 5.
    let pitch = 128u64;
    let base = dev.alloc((rows * pitch * 4) as usize).unwrap();
    upload(&dev, base, &vec![0u8; (rows * pitch * 4) as usize]);
    let view = unsafe { DeviceView::new(base + 5 * 4, vec![pitch, 1]) };
    let region = Region::new(vec![0, 100], vec![rows, 100]).unwrap();
    let t = DeviceTarget::new(key.clone(), DType::Float32, vec![rows, cols], region, view).unwrap();
    let mut staging = DeviceStaging::new(dev.clone(), 64 << 10);
    let comm = zarrckpt::LocalComm::single();
    let rep = load_to_device(
        &mut [],
        &[t],
        &mut staging,
        &dir,
        &comm,
        &LoadOptions::default(),
    )
    .unwrap();
    assert!(rep.rounds > 1);
    let got = download(&dev, base, (rows * pitch * 4) as usize);
    for y in 0..rows as usize {
        for x in 0..pitch as usize {
            let g = &got[(y * pitch as usize + x) * 4..][..4];
            let want: &[u8] = if (5..105).contains(&x) {
                &full[(y * cols as usize + x - 5 + 100) * 4..][..4]
            } else {
                &[0, 0, 0, 0]
            };
            assert_eq!(g, want, "element ({y}, {x})");
        }
    }
    unsafe { dev.free(base) }.unwrap();
}

/// Saving from device memory, sync and async, read back on the host.
#[test]
fn saves_from_device_memory() {
    let Some(dev) = gpu() else { return };
    let dir = tempfile::tempdir().unwrap();
    let shape = vec![64u64, 33];
    let n = (64 * 33 * 2) as usize;
    let data = pattern(n, 3);
    let base = dev.alloc(n).unwrap();
    upload(&dev, base, &data);
    let key = TensorKey::new("x").unwrap();
    let comm: Arc<dyn Communicator> = Arc::new(zarrckpt::LocalComm::single());
    let mut saver = zarrckpt::Saver::new(comm.clone());
    let piece = DevicePiece::new(
        key.clone(),
        DType::BFloat16,
        shape.clone(),
        Region::new(vec![0, 0], shape.clone()).unwrap(),
        0,
        unsafe { DeviceView::contiguous(base, &shape) },
    )
    .unwrap();
    let request = zarrckpt::SaveRequest::new().with_device_tensors(dev.clone(), [piece]);
    saver
        .save(&request, &dir.path().join("a"), &SaveOptions::default())
        .unwrap();
    let h = saver
        .save_async(&request, &dir.path().join("b"), &SaveOptions::default())
        .unwrap();
    upload(&dev, base, &vec![0u8; n]); // changing device memory after the call is fine
    h.wait().unwrap();
    for step in ["a", "b"] {
        let mut buf = vec![0u8; n];
        let mut t = [LoadTarget::new(
            key.clone(),
            DType::BFloat16,
            shape.clone(),
            Region::new(vec![0, 0], shape.clone()).unwrap(),
            &mut buf,
        )
        .unwrap()];
        load(
            &mut t,
            &dir.path().join(step),
            &*comm,
            &LoadOptions::default(),
        )
        .unwrap();
        assert!(buf == data, "step {step} differs");
    }
    unsafe { dev.free(base) }.unwrap();
}

/// NCCL with one rank (one GPU): a self-exchange moves the bytes through device memory,
/// and a load runs over the NCCL communicator.
#[cfg(feature = "nccl")]
#[test]
fn nccl_communicator_moves_bytes() {
    use zarrckpt::comm::{RecvBuf, SendBuf};
    use zarrckpt::device::NcclComm;
    let Some(dev) = gpu() else { return };
    let boot: Arc<dyn Communicator> = Arc::new(zarrckpt::LocalComm::single());
    let comm = match NcclComm::new(dev.clone(), boot) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("SKIPPED: NCCL unavailable: {e}");
            return;
        }
    };
    let data = pattern(3 << 20, 9);
    let mut got = vec![0u8; data.len()];
    comm.exchange(
        &[SendBuf {
            peer: 0,
            data: &data,
        }],
        &mut [RecvBuf {
            peer: 0,
            buf: &mut got,
        }],
    )
    .unwrap();
    assert!(got == data);
    // Mismatched sizes are an error, not a hang.
    let mut short = vec![0u8; 10];
    let e = comm
        .exchange(
            &[SendBuf {
                peer: 0,
                data: &data[..11],
            }],
            &mut [RecvBuf {
                peer: 0,
                buf: &mut short,
            }],
        )
        .unwrap_err();
    assert!(e.to_string().contains("sizes"), "{e}");
}

/// NCCL with one rank (one GPU), the communicator's whole surface: the collectives (the
/// shared ones of `comm::collective`, run over the bootstrap), several messages in one
/// exchange through device memory, and an empty exchange.
#[cfg(feature = "nccl")]
#[test]
fn nccl_communicator_collectives_with_one_rank() {
    use zarrckpt::CommError;
    use zarrckpt::comm::{RecvBuf, SendBuf};
    use zarrckpt::device::NcclComm;
    let Some(dev) = gpu() else { return };
    let boot: Arc<dyn Communicator> = Arc::new(zarrckpt::LocalComm::single());
    let comm = match NcclComm::new(dev.clone(), boot) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("SKIPPED: NCCL unavailable: {e}");
            return;
        }
    };
    assert_eq!((comm.rank(), comm.world_size()), (0, 1));
    let max = |a: &[u8], b: &[u8]| -> Result<Vec<u8>, String> {
        Ok(a.iter().zip(b).map(|(x, y)| *x.max(y)).collect())
    };
    assert_eq!(comm.all_reduce(b"abc", &max).unwrap(), b"abc");
    assert_eq!(
        comm.broadcast(0, b"from the root").unwrap(),
        b"from the root"
    );
    assert_eq!(comm.all_gather(b"mine").unwrap(), vec![b"mine".to_vec()]);
    comm.barrier().unwrap();
    let (a, b) = (pattern(1 << 20, 4), pattern(4099, 5));
    let (mut got_a, mut got_b) = (vec![0u8; a.len()], vec![0u8; b.len()]);
    comm.exchange(
        &[SendBuf { peer: 0, data: &a }, SendBuf { peer: 0, data: &b }],
        &mut [
            RecvBuf {
                peer: 0,
                buf: &mut got_a,
            },
            RecvBuf {
                peer: 0,
                buf: &mut got_b,
            },
        ],
    )
    .unwrap();
    assert!(got_a == a && got_b == b);
    comm.exchange(&[], &mut []).unwrap();
    // Still usable after the exchanges; a root out of range is an error, not a hang.
    assert_eq!(comm.all_reduce(b"z", &max).unwrap(), b"z");
    assert!(matches!(
        comm.broadcast(1, b"x"),
        Err(CommError::Mismatch { .. })
    ));
}

/// NCCL past its deadline: a transfer given 1 ns cannot finish in time, so the wait aborts
/// the communicator (`ncclCommAbort`) and returns a timeout within moments, and the aborted
/// communicator refuses the next exchange instead of using a freed handle.
#[cfg(feature = "nccl")]
#[test]
fn nccl_transfer_past_its_deadline_is_aborted() {
    use std::time::Instant;
    use zarrckpt::CommError;
    use zarrckpt::comm::{RecvBuf, SendBuf};
    use zarrckpt::device::NcclComm;
    let Some(dev) = gpu() else { return };
    let boot: Arc<dyn Communicator> = Arc::new(zarrckpt::LocalComm::single());
    let comm = match NcclComm::new(dev.clone(), boot) {
        Ok(c) => c.with_timeout(Duration::from_nanos(1)),
        Err(e) => {
            eprintln!("SKIPPED: NCCL unavailable: {e}");
            return;
        }
    };
    let data = pattern(256 << 20, 3);
    let mut got = vec![0u8; data.len()];
    let start = Instant::now();
    let e = comm
        .exchange(
            &[SendBuf {
                peer: 0,
                data: &data,
            }],
            &mut [RecvBuf {
                peer: 0,
                buf: &mut got,
            }],
        )
        .unwrap_err();
    assert!(matches!(e, CommError::Timeout { .. }), "{e:?}");
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "{:?}",
        start.elapsed()
    );
    let mut small = [0u8; 4];
    let e = comm
        .exchange(
            &[SendBuf {
                peer: 0,
                data: &data[..4],
            }],
            &mut [RecvBuf {
                peer: 0,
                buf: &mut small,
            }],
        )
        .unwrap_err();
    assert!(e.to_string().contains("aborted"), "{e}");
}
