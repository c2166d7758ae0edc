//! Synthetic model states laid out over ranks: what each rank holds when saving and asks for
//! when loading, for `demo` and `bench`.

use zarrckpt::synth::{SynthModel, SynthTensor};
use zarrckpt::{LoadTarget, Region, ShardedTensor};

/// Tensor parallelism x data parallelism: rank r has tensor-parallel rank `r % tp` and
/// data-parallel rank `r / tp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Topology {
    /// Tensor-parallel size.
    pub tp: u64,
    /// Data-parallel size.
    pub dp: u64,
}

impl Topology {
    /// Number of ranks.
    pub fn world(&self) -> u64 {
        self.tp * self.dp
    }

    /// The box and replica id of `t` on `rank`.
    pub fn piece(&self, t: &SynthTensor, rank: u64) -> (Region, u32) {
        let (tp_rank, dp_rank) = (rank % self.tp, rank / self.tp);
        let region = t.region(tp_rank, self.tp);
        let replica = if t.split_axis.is_some() { dp_rank } else { rank };
        (region, u32::try_from(replica).unwrap_or(u32::MAX))
    }
}

/// One rank's pieces with their generated contents.
pub struct Held {
    /// (tensor index, box, replica id, bytes).
    pub pieces: Vec<(usize, Region, u32, Vec<u8>)>,
}

impl Held {
    /// Generates rank `rank`'s pieces of `model` under `topo`.
    pub fn generate(model: &SynthModel, topo: Topology, rank: u64) -> Held {
        let pieces = model
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let (region, replica) = topo.piece(t, rank);
                let mut buf = vec![0u8; region.num_elements().unwrap_or(0) as usize * t.dtype.size()];
                t.fill(&region, &mut buf);
                (i, region, replica, buf)
            })
            .collect();
        Held { pieces }
    }

    /// The pieces as the library takes them.
    pub fn sharded<'a>(&'a self, model: &SynthModel) -> Vec<ShardedTensor<'a>> {
        self.pieces
            .iter()
            .map(|(i, region, replica, buf)| {
                let t = &model.tensors[*i];
                ShardedTensor::new(t.key.clone(), t.dtype, t.shape.clone(), region.clone(), *replica, buf)
                    .expect("generated pieces are valid")
            })
            .collect()
    }
}

/// One rank's load buffers.
pub struct Wanted {
    /// (tensor index, box, buffer).
    pub pieces: Vec<(usize, Region, Vec<u8>)>,
}

impl Wanted {
    /// Allocates rank `rank`'s buffers under `topo`, touching every page (as a model's
    /// parameters would be) so that timing excludes first-touch page faults.
    pub fn allocate(model: &SynthModel, topo: Topology, rank: u64) -> Wanted {
        let pieces = model
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let (region, _) = topo.piece(t, rank);
                let buf = vec![0x5Au8; region.num_elements().unwrap_or(0) as usize * t.dtype.size()];
                (i, region, buf)
            })
            .collect();
        Wanted { pieces }
    }

    /// Load targets over the buffers.
    pub fn targets<'a>(&'a mut self, model: &SynthModel) -> Vec<LoadTarget<'a>> {
        self.pieces
            .iter_mut()
            .map(|(i, region, buf)| {
                let t = &model.tensors[*i];
                LoadTarget::new(t.key.clone(), t.dtype, t.shape.clone(), region.clone(), buf).expect("valid targets")
            })
            .collect()
    }

    /// Checks every byte; returns the first wrong (key, byte offset).
    pub fn check(&self, model: &SynthModel) -> Result<(), String> {
        for (i, region, buf) in &self.pieces {
            let t = &model.tensors[*i];
            if let Some(off) = t.check(region, buf) {
                return Err(format!("tensor `{}` region {region}: wrong byte at offset {off}", t.key));
            }
        }
        Ok(())
    }
}
