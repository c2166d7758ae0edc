//! `zarrckpt export`: a checkpoint's full tensors into one safetensors file.

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use safetensors::{Dtype, View};
use zarrckpt::{Checkpoint, TensorKey};

use crate::import::safetensors_dtype;
use crate::progress;

/// Arguments of `zarrckpt export`.
#[derive(clap::Args)]
pub struct Args {
    /// The checkpoint directory.
    ckpt: PathBuf,
    /// The safetensors file to write.
    #[arg(long)]
    out: PathBuf,
}

/// A tensor read from the checkpoint only when the writer asks for its bytes, so the export
/// holds one tensor in memory at a time.
struct Lazy<'a> {
    ckpt: &'a Checkpoint,
    key: TensorKey,
    dtype: Dtype,
    shape: Vec<usize>,
    len: usize,
    error: &'a RefCell<Option<anyhow::Error>>,
    pb: &'a indicatif::ProgressBar,
}

impl View for Lazy<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        // After the first error nothing more is read, and nothing is made up in its place
        // (the partial file is removed): a damaged index declaring huge tensors costs neither
        // memory nor disk.
        if self.error.borrow().is_some() {
            return Cow::Borrowed(&[]);
        }
        match self.ckpt.read_tensor(&self.key) {
            Ok(v) => {
                self.pb.inc(v.len() as u64);
                Cow::Owned(v)
            }
            Err(e) => {
                self.error.borrow_mut().get_or_insert(anyhow::Error::new(e));
                Cow::Borrowed(&[])
            }
        }
    }
    fn data_len(&self) -> usize {
        self.len
    }
}

pub fn run(a: &Args) -> anyhow::Result<ExitCode> {
    let ckpt = Checkpoint::open(&a.ckpt)?;
    let infos = ckpt.tensors();
    let total: u64 = infos.iter().map(|t| t.nbytes).sum();
    let pb = progress::bytes(total, "export");
    let error = RefCell::new(None);
    let views: Vec<(String, Lazy)> = infos
        .iter()
        .map(|t| {
            let lazy = Lazy {
                ckpt: &ckpt,
                key: t.key.clone(),
                dtype: safetensors_dtype(t.dtype),
                shape: t.shape.iter().map(|&d| d as usize).collect(),
                len: t.nbytes as usize,
                error: &error,
                pb: &pb,
            };
            (t.key.to_string(), lazy)
        })
        .collect();
    let meta: Option<HashMap<String, String>> =
        ckpt.meta().user.get("safetensors_metadata").and_then(|m| {
            m.as_object().map(|o| {
                o.iter()
                    .filter_map(|(k, v)| v.as_str().map(|s| (k.clone(), s.to_owned())))
                    .collect()
            })
        });
    let t0 = Instant::now();
    let tmp = a.out.with_extension("safetensors.partial");
    let written = safetensors::serialize_to_file(views, meta, &tmp)
        .with_context(|| format!("write {}", tmp.display()));
    pb.finish_and_clear();
    if let Some(e) = error.into_inner() {
        let _ = std::fs::remove_file(&tmp);
        return Err(e.context(format!("reading {}", a.ckpt.display())));
    }
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, &a.out).with_context(|| format!("rename to {}", a.out.display()))?;
    println!(
        "exported {} tensors ({:.3} GB) to {} in {:.2} s",
        infos.len(),
        total as f64 / 1e9,
        a.out.display(),
        t0.elapsed().as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}
