//! A small training state for save tests: row- and column-split weights (a column split
//! with several chunks per piece), a replicated norm and step counter, and a tensor whose
//! pieces do not line up with any chunk grid (parts exchanged between ranks). Contents
//! depend on a step number, so successive saves differ.

use std::path::Path;

use super::{chunk_split, cut, tensor_bytes};
use zarrckpt::{Checkpoint, DType, Region, ShardedTensor, TensorKey};

/// One tensor of the state.
pub struct Spec {
    pub key: &'static str,
    pub dtype: DType,
    pub shape: Vec<u64>,
}

pub fn specs() -> Vec<Spec> {
    vec![
        Spec {
            key: "model.rows.weight",
            dtype: DType::Float32,
            shape: vec![64, 48],
        },
        Spec {
            key: "model.cols.weight",
            dtype: DType::BFloat16,
            shape: vec![40, 60],
        },
        Spec {
            key: "model.norm",
            dtype: DType::Float32,
            shape: vec![48],
        },
        Spec {
            key: "model.uneven",
            dtype: DType::Float32,
            shape: vec![40, 300],
        },
        Spec {
            key: "optimizer.step",
            dtype: DType::Int64,
            shape: vec![],
        },
    ]
}

/// The full contents of tensor `i` at `step`.
pub fn full(i: usize, step: u64) -> Vec<u8> {
    let s = &specs()[i];
    tensor_bytes(i as u64 + 1 + 1000 * step, &s.shape, s.dtype)
}

fn region(offset: Vec<u64>, shape: Vec<u64>) -> Region {
    Region::new(offset, shape).unwrap()
}

/// (tensor index, box, replica id) of every piece rank `rank` of `world` holds.
pub fn layout(world: u64, rank: u64) -> Vec<(usize, Region, u32)> {
    let mut out = Vec::new();
    let (o, l) = chunk_split(64, world)[rank as usize];
    out.push((0, region(vec![o, 0], vec![l, 48]), 0));
    // Columns: rank 0 holds [0, 20), the others split [20, 60); with two ranks, rank 1's
    // piece spans two chunks of 20 columns (a non-contiguous part of its buffer each).
    let cols = if world == 1 {
        (0, 60)
    } else if rank == 0 {
        (0, 20)
    } else {
        let (o, l) = chunk_split(40, world - 1)[rank as usize - 1];
        (20 + o, l)
    };
    out.push((1, region(vec![0, cols.0], vec![40, cols.1]), 0));
    out.push((2, region(vec![0], vec![48]), rank as u32));
    for (i, (a, b)) in [(0u64, 7u64), (7, 17), (17, 40)].into_iter().enumerate() {
        if i as u64 % world == rank {
            out.push((3, region(vec![a, 0], vec![b - a, 300]), 0));
        }
    }
    out.push((4, region(vec![], vec![]), rank as u32));
    out
}

/// One rank's buffers.
pub struct RankState {
    pub pieces: Vec<(usize, Region, u32, Vec<u8>)>,
}

impl RankState {
    /// Rank `rank`'s pieces with the contents of `step`.
    pub fn new(world: u64, rank: u64, step: u64) -> Self {
        let specs = specs();
        let pieces = layout(world, rank)
            .into_iter()
            .map(|(i, r, rep)| {
                let s = &specs[i];
                let bytes = cut(&full(i, step), &s.shape, &r, s.dtype.size());
                (i, r, rep, bytes)
            })
            .collect();
        RankState { pieces }
    }

    /// The pieces as the library takes them.
    pub fn sharded(&self) -> Vec<ShardedTensor<'_>> {
        let specs = specs();
        self.pieces
            .iter()
            .map(|(i, r, rep, b)| {
                let s = &specs[*i];
                ShardedTensor::new(
                    TensorKey::new(s.key).unwrap(),
                    s.dtype,
                    s.shape.clone(),
                    r.clone(),
                    *rep,
                    b,
                )
                .unwrap()
            })
            .collect()
    }

    /// Overwrites every byte (a training step after the save call returned).
    pub fn scribble(&mut self, byte: u8) {
        for (_, _, _, b) in &mut self.pieces {
            b.fill(byte);
        }
    }
}

/// Checks that the checkpoint at `dir` holds every tensor exactly as at `step`.
pub fn check(dir: &Path, step: u64) {
    let ck = Checkpoint::open(dir).unwrap_or_else(|e| panic!("open {}: {e}", dir.display()));
    for (i, s) in specs().iter().enumerate() {
        let got = ck.read_tensor(&TensorKey::new(s.key).unwrap()).unwrap();
        assert!(
            got == full(i, step),
            "{}: tensor `{}` differs from step {step}",
            dir.display(),
            s.key
        );
    }
}
