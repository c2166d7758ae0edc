//! Streaming a plan's destinations out of a checkpoint into safetensors files: one batch of
//! destinations at a time (those that share source boxes, each merged box read once), with
//! whole groups (an HF file, a vLLM rank) handed to parallel writers.

use std::ops::Range;
use std::path::Path;

use super::error::FormatError;
use super::exec::{FillStats, fill_from_checkpoint};
use super::plan::Plan;
use super::safetensors::{Entry, write_file};
use crate::Checkpoint;

/// One output file: its name in the output folder and the destinations it holds, in order.
/// The files of one group are written one after the other by one writer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutFile {
    /// The file's name.
    pub name: String,
    /// The group (HF file, vLLM rank) of its destinations.
    pub group: usize,
    /// Indices into [`Plan::dests`].
    pub dests: Vec<usize>,
}

/// What writing files cost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriteStats {
    /// Bytes read from the checkpoint.
    pub bytes_read: u64,
    /// Tensor bytes written.
    pub bytes_written: u64,
    /// The most batch memory one writer held at once.
    pub peak_bytes: u64,
    /// Writers that ran (each writing whole groups).
    pub writers: usize,
}

/// How to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteOptions {
    /// Parallel writers (threads), each writing whole groups; 0 counts as 1.
    pub writers: usize,
    /// Read the next batch in a second thread while writing the current one (at most two
    /// batches in memory). Measured slower on 2 shared cores (bench-convert), so off by
    /// default.
    pub pipeline: bool,
}

impl Default for WriteOptions {
    fn default() -> Self {
        WriteOptions {
            writers: 1,
            pipeline: false,
        }
    }
}

/// One file per group, every destination of the group in plan order.
#[must_use]
pub fn file_per_group(plan: &Plan, name: &dyn Fn(usize) -> String) -> Vec<OutFile> {
    let mut files: Vec<OutFile> = Vec::new();
    for (i, d) in plan.dests.iter().enumerate() {
        match files.iter_mut().find(|f| f.group == d.group) {
            Some(f) => f.dests.push(i),
            None => files.push(OutFile {
                name: name(d.group),
                group: d.group,
                dests: vec![i],
            }),
        }
    }
    files
}

/// Writes `files` into `out` (which must exist), reading from `ck`. Groups are dealt to the
/// writers round robin (group `k` of the files' groups to writer `k % writers`).
///
/// # Errors
/// The first error of any writer: reading the checkpoint, writing a file. Files finished
/// before it stay.
pub fn write_files(
    ck: &Checkpoint,
    plan: &Plan,
    files: &[OutFile],
    out: &Path,
    opts: WriteOptions,
) -> Result<WriteStats, FormatError> {
    let mut groups: Vec<usize> = files.iter().map(|f| f.group).collect();
    groups.dedup();
    let writers = opts.writers.clamp(1, groups.len().max(1));
    let mine = |w: usize| -> Vec<&OutFile> {
        files
            .iter()
            .filter(|f| {
                groups
                    .iter()
                    .position(|&g| g == f.group)
                    .is_some_and(|k| k % writers == w)
            })
            .collect()
    };
    if writers == 1 {
        return write_some(ck, plan, &mine(0), out, opts.pipeline);
    }
    // Each writer its own thread: the checkpoint's reads and the files' writes of one group
    // do not wait for another's.
    let results: Vec<Result<WriteStats, FormatError>> = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..writers)
            .map(|w| {
                let my = mine(w);
                sc.spawn(move || write_some(ck, plan, &my, out, opts.pipeline))
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(index, h)| {
                h.join()
                    .unwrap_or(Err(FormatError::Writer { index, writers }))
            })
            .collect()
    });
    let mut total = WriteStats {
        writers,
        ..WriteStats::default()
    };
    for r in results {
        let s = r?;
        total.bytes_read += s.bytes_read;
        total.bytes_written += s.bytes_written;
        total.peak_bytes = total.peak_bytes.max(s.peak_bytes);
    }
    Ok(total)
}

type Filled = Result<(Range<usize>, Vec<Vec<u8>>, FillStats), FormatError>;

fn fill_batch(ck: &Checkpoint, plan: &Plan, b: Range<usize>) -> Filled {
    let mut bufs: Vec<Vec<u8>> = b
        .clone()
        .map(|i| vec![0u8; plan.dests[i].nbytes() as usize])
        .collect();
    let mut views: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    let st = fill_from_checkpoint(ck, plan, b.clone(), &mut views)
        .map_err(FormatError::ckpt(ck.dir()))?;
    Ok((b, bufs, st))
}

/// One writer: `files` in order, the batches of their destinations read in the same order.
fn write_some(
    ck: &Checkpoint,
    plan: &Plan,
    files: &[&OutFile],
    out: &Path,
    pipeline: bool,
) -> Result<WriteStats, FormatError> {
    let batches = plan.batches();
    let mut order: Vec<Range<usize>> = Vec::new();
    for f in files {
        for &d in &f.dests {
            // Batches are consecutive ranges of destinations, in order.
            let k = batches.partition_point(|b| b.end <= d);
            if order.last().is_none_or(|b| !b.contains(&d))
                && let Some(b) = batches.get(k).filter(|b| b.contains(&d))
            {
                order.push(b.clone());
            }
        }
    }
    if !pipeline {
        let mut it = order.into_iter();
        let mut next = || it.next().map(|b| fill_batch(ck, plan, b));
        return consume(plan, files, out, &mut next, false);
    }
    std::thread::scope(|sc| {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Filled>(0);
        sc.spawn(move || {
            for b in order {
                let r = fill_batch(ck, plan, b);
                let failed = r.is_err();
                if tx.send(r).is_err() || failed {
                    break;
                }
            }
        });
        let mut next = || rx.recv().ok();
        consume(plan, files, out, &mut next, true)
    })
}

/// Writes `files`, taking filled batches in order from `next`.
fn consume(
    plan: &Plan,
    files: &[&OutFile],
    out: &Path,
    next: &mut dyn FnMut() -> Option<Filled>,
    pipeline: bool,
) -> Result<WriteStats, FormatError> {
    let mut st = WriteStats {
        writers: 1,
        ..WriteStats::default()
    };
    let mut prev_held = 0u64;
    let mut bufs: Vec<Vec<u8>> = Vec::new();
    let mut cur: Option<Range<usize>> = None;
    let metadata: serde_json::Map<String, serde_json::Value> =
        [("format".to_string(), serde_json::Value::from("pt"))]
            .into_iter()
            .collect();
    for f in files {
        let entries: Vec<Entry> = f
            .dests
            .iter()
            .map(|&i| {
                let d = &plan.dests[i];
                Entry {
                    name: d.name.clone(),
                    dtype: d.dtype,
                    shape: d.shape.clone(),
                }
            })
            .collect();
        let path = out.join(&f.name);
        st.bytes_written += write_file(&path, &entries, Some(&metadata), |k, sink| {
            let di = f.dests[k];
            if cur.as_ref().is_none_or(|c| !c.contains(&di)) {
                let (b, filled, fs) = next().ok_or_else(|| FormatError::Header {
                    path: path.clone(),
                    tensor: plan.dests[di].name.clone(),
                    msg: "the batch reader stopped before this tensor".into(),
                })??;
                st.bytes_read += fs.bytes_read;
                let held: u64 =
                    fs.bytes_needed + filled.iter().map(|b| b.len() as u64).sum::<u64>();
                // With the pipeline, this batch and the one the reader fills meanwhile.
                st.peak_bytes = st
                    .peak_bytes
                    .max(held + if pipeline { prev_held } else { 0 });
                prev_held = held;
                bufs = filled;
                cur = Some(b);
            }
            let start = cur.as_ref().map_or(0, |c| c.start);
            match cur.as_ref().filter(|c| c.contains(&di)) {
                Some(_) => {
                    let buf = std::mem::take(&mut bufs[di - start]);
                    sink(&buf).map_err(FormatError::io("write", &path))
                }
                None => Err(FormatError::Header {
                    path: path.clone(),
                    tensor: plan.dests[di].name.clone(),
                    msg: "its batch was read out of order".into(),
                }),
            }
        })?;
    }
    Ok(st)
}
