//! Importing a Hugging Face folder (config.json and safetensors files, mapped) into a
//! Megatron layout: a `zarrckpt.megatron` checkpoint directory.

use std::collections::BTreeMap;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use memmap2::Mmap;
use safetensors::SafeTensors;

use super::check::Inventory;
use super::describe::describe;
use super::error::FormatError;
use super::exec::{borrowable, fill_from_sources};
use super::expand::{Layout, object_keys};
use super::hf::read_json;
use super::plan::{Plan, plan_megatron_import};
use super::safetensors::from_safetensors;
use super::table::Table;
use crate::{DType, LocalComm, Region, SaveOptions, ShardedTensor, StateObject, TensorKey};

/// One tensor of an HF folder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HfTensor {
    /// The file (index into the folder's files).
    pub file: usize,
    /// Data type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<u64>,
    /// Its bytes within the mapped file.
    bytes: Range<usize>,
}

/// The safetensors files of a folder, mapped read-only.
pub struct HfDir {
    files: Vec<PathBuf>,
    maps: Vec<Mmap>,
    /// Tensors by name.
    pub tensors: BTreeMap<String, HfTensor>,
}

impl HfDir {
    /// Maps every `*.safetensors` file of `dir`.
    ///
    /// # Errors
    /// A folder without such files, a file that does not parse, a data type zarrckpt lacks,
    /// a tensor in two files.
    pub fn open(dir: &Path) -> Result<HfDir, FormatError> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(FormatError::io("read", dir))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(FormatError::NoFiles {
                path: dir.to_owned(),
            });
        }
        let mut maps = Vec::new();
        let mut tensors: BTreeMap<String, HfTensor> = BTreeMap::new();
        for (fi, p) in files.iter().enumerate() {
            let f = File::open(p).map_err(FormatError::io("open", p))?;
            // SAFETY: a read-only mapping of a file this process does not modify (as every
            // safetensors reader; concurrent writers are not guarded against).
            let m = unsafe { Mmap::map(&f) }.map_err(FormatError::io("map", p))?;
            let st = SafeTensors::deserialize(&m).map_err(|e| FormatError::Safetensors {
                path: p.clone(),
                msg: e.to_string(),
            })?;
            let base = m.as_ptr() as usize;
            for (name, v) in st.tensors() {
                let dtype = from_safetensors(v.dtype()).ok_or_else(|| FormatError::Dtype {
                    path: p.clone(),
                    tensor: name.clone(),
                    dtype: format!("{:?}", v.dtype()),
                    msg: "zarrckpt does not store",
                })?;
                let start = v.data().as_ptr() as usize - base;
                let t = HfTensor {
                    file: fi,
                    dtype,
                    shape: v.shape().iter().map(|&d| d as u64).collect(),
                    bytes: start..start + v.data().len(),
                };
                if let Some(prev) = tensors.insert(name.clone(), t) {
                    return Err(FormatError::DuplicateTensor {
                        tensor: name,
                        first: files[prev.file].clone(),
                        second: p.clone(),
                    });
                }
            }
            maps.push(m);
        }
        Ok(HfDir {
            files,
            maps,
            tensors,
        })
    }

    /// The files, in the order `HfTensor::file` counts them.
    #[must_use]
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// The inventory.
    #[must_use]
    pub fn inventory(&self) -> Inventory {
        self.tensors
            .iter()
            .map(|(k, t)| (k.clone(), (t.dtype.to_string(), t.shape.clone())))
            .collect()
    }

    /// A tensor's bytes (empty for a name the folder lacks).
    #[must_use]
    pub fn data(&self, name: &str) -> &[u8] {
        self.tensors
            .get(name)
            .map_or(&[], |t| &self.maps[t.file][t.bytes.clone()])
    }
}

/// What an import wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct ImportReport {
    /// HF tensors read.
    pub hf_tensors: usize,
    /// Megatron tensors written.
    pub megatron_tensors: usize,
    /// Rank boxes written.
    pub boxes: usize,
    /// Tensor bytes written.
    pub bytes: u64,
    /// Of them, saved straight from the mapped HF files.
    pub borrowed: u64,
    /// Shard files written.
    pub chunks_written: usize,
    /// Planning time.
    pub planning: Duration,
    /// The whole import.
    pub elapsed: Duration,
}

/// A planned import of an HF folder into a Megatron layout: checked from the folder's headers
/// alone, nothing written yet.
pub struct HfImport {
    source: PathBuf,
    dir: HfDir,
    table: Table,
    cfg: serde_json::Value,
    layout: Layout,
    plan: Plan,
    started: Instant,
}

impl HfImport {
    /// Plans the import of the folder `hf` (config.json and safetensors) at `layout`.
    ///
    /// # Errors
    /// [`FormatError::Plan`] for a refused conversion; reading errors.
    pub fn plan(hf: &Path, table: &Table, layout: Layout) -> Result<HfImport, FormatError> {
        let started = Instant::now();
        let cfg = read_json(&hf.join("config.json"))?;
        let dir = HfDir::open(hf)?;
        let plan = plan_megatron_import(table, &cfg, layout, &dir.inventory())?;
        Ok(HfImport {
            source: hf.to_owned(),
            dir,
            table: table.clone(),
            cfg,
            layout,
            plan,
            started,
        })
    }

    /// The plan.
    #[must_use]
    pub fn plan_ref(&self) -> &Plan {
        &self.plan
    }

    /// The plan as the dry run prints it.
    #[must_use]
    pub fn describe(&self) -> String {
        describe(
            &self.plan,
            &format!(
                "import {} -> Megatron {} with table `{}`",
                self.source.display(),
                self.layout,
                self.table.name
            ),
            "tp rank",
        )
    }

    /// Writes the Megatron checkpoint directory `out` (`metadata.json` naming the zarrckpt
    /// backend, the checkpoint in `out/zarrckpt`) with `io_threads` writer threads (0: the
    /// default). Boxes that are one contiguous run of an HF tensor are saved straight from the
    /// mapped files; the others are assembled one at a time into a scratch file next to the
    /// output, mapped back read-only, so that the heap holds one box at a time.
    ///
    /// # Errors
    /// [`FormatError::NotEmpty`] when `out` holds files and `overwrite` is false; saving.
    pub fn write(
        &self,
        out: &Path,
        overwrite: bool,
        io_threads: usize,
    ) -> Result<ImportReport, FormatError> {
        let planning = self.started.elapsed();
        let plan = &self.plan;
        let src: Vec<&[u8]> = plan
            .sources
            .iter()
            .map(|s| self.dir.data(&s.name))
            .collect();
        let nonempty = std::fs::read_dir(out).is_ok_and(|mut d| d.next().is_some());
        if nonempty && !overwrite {
            return Err(FormatError::NotEmpty {
                path: out.to_owned(),
            });
        }
        std::fs::create_dir_all(out).map_err(FormatError::io("create", out))?;
        let scratch_path = out.join(".zarrckpt-import-scratch");
        let r = self.save(out, &scratch_path, &src, overwrite, io_threads);
        let _ = std::fs::remove_file(&scratch_path);
        let (chunks_written, borrowed) = r?;
        let cfgm = serde_json::json!({"sharded_backend": "zarrckpt", "sharded_backend_version": 1, "common_backend": "zarrckpt", "common_backend_version": 1});
        let p = out.join("metadata.json");
        std::fs::write(&p, cfgm.to_string()).map_err(FormatError::io("write", &p))?;
        Ok(ImportReport {
            hf_tensors: plan.sources.len(),
            megatron_tensors: plan.expanded.m.len(),
            boxes: plan.dests.len(),
            bytes: plan.dests.iter().map(|d| d.nbytes()).sum(),
            borrowed,
            chunks_written,
            planning,
            elapsed: self.started.elapsed(),
        })
    }

    /// Assembles the boxes that are not contiguous runs and saves; returns (shard files,
    /// bytes saved straight from the mapped files).
    fn save(
        &self,
        out: &Path,
        scratch_path: &Path,
        src: &[&[u8]],
        overwrite: bool,
        io_threads: usize,
    ) -> Result<(usize, u64), FormatError> {
        use std::os::unix::fs::FileExt;
        let plan = &self.plan;
        let mut at: Vec<Option<(usize, usize)>> = vec![None; plan.dests.len()];
        let mut borrowed = 0u64;
        let mut assembled = 0usize;
        for (i, slot) in at.iter_mut().enumerate() {
            if borrowable(plan, i).is_some() {
                borrowed += plan.dests[i].nbytes();
            } else {
                let n =
                    usize::try_from(plan.dests[i].nbytes()).map_err(|_| FormatError::Option {
                        option: "import",
                        msg: format!(
                            "{}: a box larger than this machine's memory",
                            plan.dests[i].name
                        ),
                    })?;
                *slot = Some((assembled, n));
                assembled += n.next_multiple_of(8);
            }
        }
        let io = |op| FormatError::io(op, scratch_path);
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(scratch_path)
            .map_err(io("create"))?;
        f.set_len(assembled as u64).map_err(io("resize"))?;
        for (i, slot) in at.iter().enumerate() {
            if let Some((off, n)) = slot {
                let mut buf = vec![0u8; *n];
                fill_from_sources(plan, i, &|k| src[k], &mut buf)?;
                f.write_all_at(&buf, *off as u64).map_err(io("write"))?;
            }
        }
        let scratch = if assembled == 0 {
            None
        } else {
            // SAFETY: a private scratch file this process created and no longer writes.
            Some(unsafe { Mmap::map(&f) }.map_err(io("map"))?)
        };
        let bad_key = |e: crate::Error| FormatError::ckpt(out)(e);
        let mut pieces = Vec::with_capacity(plan.dests.len());
        for (i, d) in plan.dests.iter().enumerate() {
            let data: &[u8] = match (&at[i], &scratch, borrowable(plan, i)) {
                (Some((off, n)), Some(m), _) => &m[*off..*off + *n],
                (_, _, Some((s, r))) => &src[s][r],
                _ => &[],
            };
            let region =
                Region::new(d.region.off.clone(), d.region.len.clone()).map_err(|source| {
                    bad_key(crate::Error::Tensor(crate::model::TensorError::Region {
                        key: d.name.clone(),
                        source,
                    }))
                })?;
            let key = TensorKey::new(&d.name).map_err(|e| bad_key(e.into()))?;
            pieces.push(
                ShardedTensor::new(key, d.dtype, d.shape.clone(), region, 0, data)
                    .map_err(|e| bad_key(e.into()))?,
            );
        }
        // Megatron's objects: the common state and the extra state of linear layers.
        let mut objects = vec![
            StateObject::common("megatron/common", serde_json::json!({}))
                .map_err(|e| bad_key(e.into()))?,
        ];
        for name in object_keys(&self.table, &self.cfg, self.layout)? {
            objects.push(
                StateObject::common(&name, serde_json::Value::Null)
                    .map_err(|e| bad_key(e.into()))?,
            );
        }
        let mut opts = SaveOptions {
            overwrite,
            io_threads,
            ..Default::default()
        };
        opts.user_metadata.insert(
            "megatron".into(),
            serde_json::json!({"tp": self.layout.tp, "pp": self.layout.pp, "ep": self.layout.ep, "table": self.table.name, "source": "zarrckpt import --hf"}),
        );
        opts.user_metadata
            .insert("hf_config".into(), self.cfg.clone());
        let _ = std::fs::remove_file(out.join("metadata.json"));
        let rep = crate::save_with_objects(
            &pieces,
            &objects,
            &out.join("zarrckpt"),
            &LocalComm::single(),
            &opts,
        )
        .map_err(bad_key)?;
        Ok((rep.chunks_written, borrowed))
    }

    /// The summary line of a finished import.
    #[must_use]
    pub fn summary(&self, out: &Path, r: &ImportReport) -> String {
        format!(
            "imported {} HF tensors into {} Megatron tensors ({} rank boxes, {:.3} GB: {:.3} GB saved straight from the mapped HF files, the rest assembled through a scratch file one box at a time) at {} into {} in {:.2} s (planning {:.3} s); {} shard files",
            r.hf_tensors,
            r.megatron_tensors,
            r.boxes,
            r.bytes as f64 / 1e9,
            r.borrowed as f64 / 1e9,
            self.layout,
            out.display(),
            r.elapsed.as_secs_f64(),
            r.planning.as_secs_f64(),
            r.chunks_written
        )
    }
}
