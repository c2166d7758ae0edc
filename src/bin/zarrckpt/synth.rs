//! Synthetic model states with deterministic contents: for demos, benchmarks, examples and
//! tests. Any rank can generate (or check) any box of any tensor without holding the rest.

use zarrckpt::model::copy::for_each_run;
use zarrckpt::model::{DType, LoadTarget, Region, ShardedTensor, TensorKey};

/// One tensor of a synthetic model and how tensor parallelism splits it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SynthTensor {
    /// Key.
    pub key: TensorKey,
    /// Data type.
    pub dtype: DType,
    /// Global shape.
    pub shape: Vec<u64>,
    /// The axis tensor parallelism splits; `None` for tensors every rank holds whole.
    pub split_axis: Option<usize>,
    /// Seed of the contents.
    pub seed: u64,
}

impl SynthTensor {
    /// Bytes of the whole tensor.
    #[must_use]
    pub fn nbytes(&self) -> u64 {
        self.shape.iter().product::<u64>() * self.dtype.size() as u64
    }

    /// The box held by tensor-parallel rank `tp_rank` of `tp`: a torch.chunk-style split
    /// (ceil-sized pieces, the last ones shorter or empty) along the split axis, or the
    /// whole tensor.
    #[must_use]
    pub fn region(&self, tp_rank: u64, tp: u64) -> Region {
        let mut r = Region::full(&self.shape);
        if let Some(axis) = self.split_axis {
            let dim = self.shape[axis];
            let size = dim.div_ceil(tp.max(1));
            let o = (tp_rank * size).min(dim);
            r = r
                .with_axis(axis, o, size.min(dim - o))
                .expect("the split axis is an axis of the tensor, the part within it");
        }
        r
    }

    /// Fills `buf`, which holds `region` of this tensor, with its deterministic contents.
    pub fn fill(&self, region: &Region, buf: &mut [u8]) {
        let elem = self.dtype.size();
        let full = Region::full(&self.shape);
        let bool_ = self.dtype == DType::Bool;
        for_each_run(&full, region, region, elem, |g, d, len| {
            fill_bytes(self.seed, g as u64, &mut buf[d..d + len]);
            if bool_ {
                buf[d..d + len].iter_mut().for_each(|b| *b &= 1);
            }
        });
    }

    /// Checks that `buf` holds `region` of this tensor; returns the first wrong byte offset.
    /// Works in blocks of at most 64 KiB, so checking allocates almost nothing.
    #[must_use]
    pub fn check(&self, region: &Region, buf: &[u8]) -> Option<usize> {
        const BLOCK: usize = 64 << 10;
        let elem = self.dtype.size();
        let full = Region::full(&self.shape);
        let mut first = None;
        let mut expect = vec![0u8; BLOCK];
        for_each_run(&full, region, region, elem, |g, d, len| {
            let mut done = 0;
            while first.is_none() && done < len {
                let n = (len - done).min(BLOCK);
                let e = &mut expect[..n];
                fill_bytes(self.seed, (g + done) as u64, e);
                if self.dtype == DType::Bool {
                    e.iter_mut().for_each(|b| *b &= 1);
                }
                if let Some(i) = e
                    .iter()
                    .zip(&buf[d + done..d + done + n])
                    .position(|(a, b)| a != b)
                {
                    first = Some(d + done + i);
                }
                done += n;
            }
        });
        first
    }
}

fn word(seed: u64, i: u64) -> u64 {
    // splitmix64 of (seed, i)
    let mut z = seed.wrapping_add(i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The bytes at global byte offsets `start..start+out.len()` of a tensor with `seed`.
fn fill_bytes(seed: u64, start: u64, out: &mut [u8]) {
    let mut pos = start;
    let mut i = 0;
    // head, up to a word boundary
    while i < out.len() && !pos.is_multiple_of(8) {
        out[i] = word(seed, pos / 8).to_le_bytes()[(pos % 8) as usize];
        i += 1;
        pos += 1;
    }
    let words = (out.len() - i) / 8;
    for (k, chunk) in out[i..i + words * 8].chunks_exact_mut(8).enumerate() {
        chunk.copy_from_slice(&word(seed, pos / 8 + k as u64).to_le_bytes());
    }
    i += words * 8;
    pos += words as u64 * 8;
    while i < out.len() {
        out[i] = word(seed, pos / 8).to_le_bytes()[(pos % 8) as usize];
        i += 1;
        pos += 1;
    }
}

/// A synthetic model: a GPT-style mix of bf16 weights split by tensor parallelism along
/// their first (column-parallel) or second (row-parallel) axis, replicated fp32 norms, fp32
/// optimizer moments with the same splits, and a replicated int64 step counter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SynthModel {
    /// The tensors.
    pub tensors: Vec<SynthTensor>,
}

impl SynthModel {
    /// A model of about `target_bytes` (at least one layer) with hidden size `hidden`.
    #[must_use]
    pub fn gpt(target_bytes: u64, hidden: u64) -> Self {
        Self::gpt_with(target_bytes, hidden, 1)
    }

    /// As [`SynthModel::gpt`], with the row-parallel layers (attention output, second MLP
    /// layer) split along `row_parallel_axis`: 1 as Megatron does, 0 to split every weight by
    /// rows (a load in another split then reads whole subchunks straight into place).
    #[must_use]
    pub fn gpt_with(target_bytes: u64, hidden: u64, row_parallel_axis: usize) -> Self {
        Self::build(target_bytes, hidden, row_parallel_axis, false)
    }

    /// A full mixed-precision training state: as [`SynthModel::gpt_with`], plus an fp32
    /// master copy of every bf16 weight (`optimizer/master/...`), split like the weight.
    #[must_use]
    pub fn training_state(target_bytes: u64, hidden: u64, row_parallel_axis: usize) -> Self {
        Self::build(target_bytes, hidden, row_parallel_axis, true)
    }

    fn build(target_bytes: u64, hidden: u64, row_parallel_axis: usize, master: bool) -> Self {
        let rp = Some(row_parallel_axis.min(1));
        let h = hidden.max(8);
        let vocab = 8 * h + 3; // not divisible by common TP sizes: uneven splits
        // Bytes per weight element: bf16 weight + 2 fp32 moments (+ fp32 master).
        let per_elem = if master { 14 } else { 10 };
        let per_layer = 12 * h * h * per_elem + 9 * h * 4 * 3;
        let embed = vocab * h * per_elem;
        let layers = (target_bytes.saturating_sub(embed) / per_layer).max(1);
        let mut b = Builder {
            master,
            ..Builder::default()
        };
        b.param("embedding.word_embeddings.weight", vec![vocab, h], Some(0));
        for l in 0..layers {
            let p = format!("decoder.layers.{l}");
            b.norm(&format!("{p}.input_layernorm.weight"), h);
            b.param(
                &format!("{p}.self_attention.linear_qkv.weight"),
                vec![3 * h, h],
                Some(0),
            );
            b.param(
                &format!("{p}.self_attention.linear_qkv.bias"),
                vec![3 * h],
                Some(0),
            );
            b.param(
                &format!("{p}.self_attention.linear_proj.weight"),
                vec![h, h],
                rp,
            );
            b.norm(&format!("{p}.pre_mlp_layernorm.weight"), h);
            b.param(
                &format!("{p}.mlp.linear_fc1.weight"),
                vec![4 * h, h],
                Some(0),
            );
            b.param(&format!("{p}.mlp.linear_fc2.weight"), vec![h, 4 * h], rp);
        }
        b.norm("decoder.final_layernorm.weight", h);
        b.push("optimizer/step", DType::Int64, vec![], None);
        let tensors = b.tensors;
        SynthModel { tensors }
    }

    /// Total bytes.
    #[must_use]
    pub fn nbytes(&self) -> u64 {
        self.tensors.iter().map(SynthTensor::nbytes).sum()
    }
}

#[derive(Default)]
struct Builder {
    tensors: Vec<SynthTensor>,
    /// Add an fp32 master copy of every bf16 weight.
    master: bool,
}

impl Builder {
    fn push(&mut self, key: &str, dtype: DType, shape: Vec<u64>, split_axis: Option<usize>) {
        let seed = self.tensors.len() as u64 + 1;
        let key = TensorKey::new(key).expect("generated keys are valid");
        self.tensors.push(SynthTensor {
            key,
            dtype,
            shape,
            split_axis,
            seed,
        });
    }

    /// A bf16 weight with its two fp32 Adam moments (and its fp32 master copy).
    fn param(&mut self, name: &str, shape: Vec<u64>, split: Option<usize>) {
        self.push(name, DType::BFloat16, shape.clone(), split);
        if self.master {
            self.push(
                &format!("optimizer/master/{name}"),
                DType::Float32,
                shape.clone(),
                split,
            );
        }
        self.push(
            &format!("optimizer/exp_avg/{name}"),
            DType::Float32,
            shape.clone(),
            split,
        );
        self.push(
            &format!("optimizer/exp_avg_sq/{name}"),
            DType::Float32,
            shape,
            split,
        );
    }

    /// A replicated fp32 norm weight.
    fn norm(&mut self, name: &str, h: u64) {
        self.push(name, DType::Float32, vec![h], None);
    }
}

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
        let replica = if t.split_axis.is_some() {
            dp_rank
        } else {
            rank
        };
        (region, u32::try_from(replica).unwrap_or(u32::MAX))
    }
}

/// Bytes of a box of a synthetic tensor (a model's tensor: its bytes fit in memory, or the
/// benchmark could not run at all).
fn bytes_of(region: &Region, dtype: DType) -> usize {
    zarrckpt::model::region::num_bytes(region.shape(), dtype.size())
        .expect("a synthetic tensor's box fits in memory")
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
                let mut buf = vec![0u8; bytes_of(&region, t.dtype)];
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
                ShardedTensor::new(
                    t.key.clone(),
                    t.dtype,
                    t.shape.clone(),
                    region.clone(),
                    *replica,
                    buf,
                )
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
                let buf = vec![0x5Au8; bytes_of(&region, t.dtype)];
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
                LoadTarget::new(t.key.clone(), t.dtype, t.shape.clone(), region.clone(), buf)
                    .expect("valid targets")
            })
            .collect()
    }

    /// Checks every byte; returns the first wrong (key, byte offset).
    pub fn check(&self, model: &SynthModel) -> Result<(), String> {
        for (i, region, buf) in &self.pieces {
            let t = &model.tensors[*i];
            if let Some(off) = t.check(region, buf) {
                return Err(format!(
                    "tensor `{}` region {region}: wrong byte at offset {off}",
                    t.key
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_fill_and_check_agree() {
        let m = SynthModel::gpt(1 << 20, 16);
        assert!(m.nbytes() > 0);
        for t in &m.tensors {
            let full = Region::full(&t.shape);
            let mut whole = vec![0u8; t.nbytes() as usize];
            t.fill(&full, &mut whole);
            for tp in [1, 3, 4] {
                let mut total = 0;
                for r in 0..tp {
                    let reg = t.region(r, tp);
                    let mut b = vec![0u8; reg.num_elements().unwrap() as usize * t.dtype.size()];
                    t.fill(&reg, &mut b);
                    assert_eq!(t.check(&reg, &b), None);
                    let mut expect = vec![0u8; b.len()];
                    zarrckpt::model::copy::copy_region(
                        &whole,
                        &full,
                        &mut expect,
                        &reg,
                        &reg,
                        t.dtype.size(),
                    );
                    assert_eq!(b, expect, "{} {r}/{tp}", t.key);
                    if !b.is_empty() {
                        b[0] ^= 1;
                        assert_eq!(t.check(&reg, &b), Some(0));
                    }
                    total += reg.num_elements().unwrap();
                }
                let n = if t.split_axis.is_some() { 1 } else { tp };
                assert_eq!(total, full.num_elements().unwrap() * n);
            }
        }
    }

    #[test]
    fn scales_with_target() {
        let small = SynthModel::gpt(64 << 20, 256).nbytes();
        let big = SynthModel::gpt(512 << 20, 256).nbytes();
        assert!(big > 4 * small, "{small} {big}");
        assert!((big as f64) < 1.3 * (512u64 << 20) as f64);
    }
}
