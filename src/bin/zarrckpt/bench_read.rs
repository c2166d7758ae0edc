//! `zarrckpt bench-read CKPT`: many small `read_region` calls on an existing checkpoint,
//! through [`Checkpoint::read_region`] (the local reader: arrays opened once, no
//! communicator) and, in the same run over the same boxes, through the collective
//! [`zarrckpt::load`] on a one-process communicator (what `read_region` did before).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use serde_json::json;
use zarrckpt::{Checkpoint, LoadOptions, LoadTarget, LocalComm, Region, TensorKey};

/// Arguments of `zarrckpt bench-read`.
#[derive(clap::Args)]
pub struct Args {
    /// The checkpoint.
    ckpt: PathBuf,
    /// Boxes read (cycling over the tensors, largest first).
    #[arg(long, default_value_t = 2000)]
    boxes: usize,
    /// Elements per box at most (a run of rows, C order).
    #[arg(long, default_value_t = 1024)]
    box_elements: u64,
    /// Rounds of (collective load, reader) pairs.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// A box of at most `max` elements of `shape` starting at pseudo-random position `seed`: a
/// span of the last axis at one index of the others.
fn small_box(shape: &[u64], max: u64, seed: u64) -> Region {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let n = shape.len();
    let mut offset = vec![0; n];
    let mut size = vec![1; n];
    for d in 0..n {
        offset[d] = next() % shape[d];
    }
    if n > 0 {
        let last = n - 1;
        offset[last] = next() % shape[last];
        size[last] = (shape[last] - offset[last]).min(max.max(1));
    }
    // Inside `shape` by construction (each offset below its extent, the last extent clipped).
    Region::within(offset, size, shape).expect("a box inside the tensor")
}

pub fn run(a: &Args) -> anyhow::Result<ExitCode> {
    let ck = Checkpoint::open(&a.ckpt)?;
    let mut tensors = ck.tensors();
    tensors.retain(|t| t.shape.iter().all(|&d| d > 0));
    anyhow::ensure!(
        !tensors.is_empty(),
        "no non-empty tensor in {}",
        a.ckpt.display()
    );
    tensors.sort_by_key(|t| std::cmp::Reverse(t.nbytes));
    let boxes: Vec<(TensorKey, Region, usize, zarrckpt::DType, Vec<u64>)> = (0..a.boxes)
        .map(|i| {
            let t = &tensors[i % tensors.len()];
            (
                t.key.clone(),
                small_box(&t.shape, a.box_elements, i as u64 + 1),
                t.dtype.size(),
                t.dtype,
                t.shape.clone(),
            )
        })
        .collect();
    let largest = boxes
        .iter()
        .map(|b| usize::try_from(b.1.num_elements().unwrap_or(0)).unwrap_or(0) * b.2)
        .max()
        .unwrap_or(0);
    let mut buf = vec![0u8; largest];
    let mut check = vec![0u8; largest];
    let (mut best_load, mut best_reader) = (f64::INFINITY, f64::INFINITY);
    let comm = LocalComm::single();
    for _ in 0..a.rounds {
        let t0 = Instant::now();
        for (key, region, elem, dtype, shape) in &boxes {
            let n = usize::try_from(region.num_elements()?)? * elem;
            let mut t = [LoadTarget::new(
                key.clone(),
                *dtype,
                shape.clone(),
                region.clone(),
                &mut check[..n],
            )?];
            zarrckpt::load(&mut t, &a.ckpt, &comm, &LoadOptions::default())?;
        }
        best_load = best_load.min(t0.elapsed().as_secs_f64());
        // A fresh checkpoint each round: its first read of each array opens it.
        let ck = Checkpoint::open(&a.ckpt)?;
        let t0 = Instant::now();
        for (key, region, elem, ..) in &boxes {
            let n = usize::try_from(region.num_elements()?)? * elem;
            ck.read_region(key, region, &mut buf[..n])?;
        }
        best_reader = best_reader.min(t0.elapsed().as_secs_f64());
    }
    // The last box read both ways agrees.
    if let Some((key, region, elem, ..)) = boxes.last() {
        let n = usize::try_from(region.num_elements()?)? * elem;
        ck.read_region(key, region, &mut buf[..n])?;
        anyhow::ensure!(
            buf[..n] == check[..n],
            "{key}: the two paths read different bytes"
        );
    }
    let per = |s: f64| s / a.boxes as f64 * 1e6;
    if a.json {
        println!(
            "{}",
            json!({
                "boxes": a.boxes,
                "tensors": tensors.len(),
                "box_elements": a.box_elements,
                "collective_load_s": best_load,
                "reader_s": best_reader,
                "collective_load_us_per_box": per(best_load),
                "reader_us_per_box": per(best_reader),
                "speedup": best_load / best_reader,
            })
        );
    } else {
        println!(
            "{} boxes of at most {} elements over {} tensors (best of {} rounds): collective load on one process {:.3} s ({:.1} us/box), reader {:.3} s ({:.1} us/box): {:.1}x",
            a.boxes,
            a.box_elements,
            tensors.len(),
            a.rounds,
            best_load,
            per(best_load),
            best_reader,
            per(best_reader),
            best_load / best_reader
        );
    }
    Ok(ExitCode::SUCCESS)
}
