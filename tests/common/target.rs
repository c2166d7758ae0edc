//! Where a test's checkpoints live: the main save / load / reshard / verify suites run each
//! test body on every [`Target`] through [`on_targets!`](crate::on_targets): a local
//! directory, the in-memory object store (`memory://`, per process) and S3 on SeaweedFS
//! (`s3://`, the binary's [`super::s3::shared`] server).
//!
//! An `s3` variant runs its body in a child process of the same test binary (`<test> --exact`)
//! whose environment points the `AWS_*` variables at the server, so the body calls the very
//! APIs the local variant calls (`save`, `load`, `Checkpoint::open`, `load_state`, the CLI, TCP
//! worker processes) with a URL instead of a directory, and the store options come from the
//! environment, as in production. The parent asserts the child ran exactly that one test and
//! passed, and prints the child's output when not.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

use super::s3;
use zarrckpt::Checkpoint;

/// Set (to the server's endpoint) in the child process an `s3` variant runs in.
pub const S3_CHILD: &str = "ZARRCKPT_TEST_S3_CHILD";

/// A storage target of a test body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// A directory under the test's temporary directory.
    Local,
    /// `memory://<unique>/...`: the in-memory object store of this process.
    Memory,
    /// `s3://<bucket>/<unique>/...` on SeaweedFS (only inside an `s3` variant's child).
    S3,
}

/// A prefix no other test of any process on the same server uses.
fn unique() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "t{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

impl Target {
    /// A fresh checkpoint location called `name`: `tmp/name` on [`Target::Local`], else a URL
    /// under a prefix of its own (as a path: every API taking a directory takes a URL).
    pub fn path(self, tmp: &Path, name: &str) -> PathBuf {
        match self {
            Target::Local => tmp.join(name),
            Target::Memory => PathBuf::from(format!("memory://{}/{name}", unique())),
            Target::S3 => {
                assert!(
                    std::env::var_os(S3_CHILD).is_some(),
                    "Target::S3 outside an `s3` variant's child process"
                );
                PathBuf::from(s3::url(&format!("{}/{name}", unique())))
            }
        }
    }

    /// True for the object stores.
    pub fn is_remote(self) -> bool {
        self != Target::Local
    }

    /// A local directory holding the checkpoint committed at `path` (itself when local; else
    /// the committed generation fetched whole, checked against its manifest's crc32c), with
    /// the temporary directory that owns it.
    pub fn local_copy(self, path: &Path) -> (Option<zarrckpt::remote::Fetched>, PathBuf) {
        if !self.is_remote() {
            return (None, path.to_path_buf());
        }
        let url = path.to_str().expect("a URL is UTF-8");
        let f = zarrckpt::remote::fetch_url(url, &zarrckpt::remote::RemoteOptions::default(), None)
            .unwrap_or_else(|e| panic!("fetch {url}: {e}"));
        let dir = f.dir().to_path_buf();
        (Some(f), dir)
    }
}

/// The relative path and bytes of every file under `dir`, sorted.
pub fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p.strip_prefix(dir).unwrap().to_string_lossy().into_owned();
                out.push((rel, std::fs::read(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

/// The first `save_id` member anywhere in the JSON `v`.
fn find_save_id(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::Object(m) => m
            .get("save_id")
            .and_then(|s| s.as_str().map(str::to_owned))
            .or_else(|| m.values().find_map(find_save_id)),
        serde_json::Value::Array(a) => a.iter().find_map(find_save_id),
        _ => None,
    }
}

/// The files of the checkpoint at `dir` with its save id (random per save, spec section 5 and
/// 7.4) masked: its hex in the JSON documents and its 16 bytes in the shard footers zeroed.
fn masked_files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let root: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("zarr.json")).unwrap()).unwrap();
    let id = find_save_id(&root).expect("a checkpoint of version 1.1 or later has a save id");
    let raw: Vec<u8> = (0..16)
        .map(|i| u8::from_str_radix(&id[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    files(dir)
        .into_iter()
        .map(|(name, mut bytes)| {
            let zero = if name.ends_with(".json") {
                id.as_bytes().to_vec()
            } else {
                raw.clone()
            };
            let mut i = 0;
            while i + zero.len() <= bytes.len() {
                if bytes[i..i + zero.len()] == zero[..] {
                    bytes[i..i + zero.len()].fill(0);
                    i += zero.len();
                } else {
                    i += 1;
                }
            }
            (name, bytes)
        })
        .collect()
}

/// The checkpoint committed at `path` on `target` holds the same files as the local
/// checkpoint `local` (the object-store generation fetched, against the directory): the same
/// names and sizes, and the same bytes but for the save id (its hex in the JSON documents, its
/// 16 bytes in every shard footer) and the 4-byte CRC-32C that closes each footer (it covers
/// the save id). So data, shard indexes, subchunk checksums and metadata are bit-identical.
pub fn assert_same_files(target: Target, path: &Path, local: &Path) {
    let (_keep, dir) = target.local_copy(path);
    let (a, b) = (masked_files(&dir), masked_files(local));
    let names = |v: &[(String, Vec<u8>)]| v.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(
        names(&a),
        names(&b),
        "{} vs {}",
        path.display(),
        local.display()
    );
    for ((n, x), (_, y)) in a.iter().zip(&b) {
        let diff: Vec<usize> = (0..x.len().min(y.len()))
            .filter(|&i| x[i] != y[i])
            .collect();
        // At most the footer's closing CRC-32C differs: 4 bytes in a row.
        let footer_crc = diff.is_empty()
            || (!n.ends_with(".json") && diff.len() <= 4 && diff[diff.len() - 1] - diff[0] < 4);
        assert!(
            x.len() == y.len() && footer_crc,
            "{n} differs between {} ({} bytes) and {} ({} bytes), at bytes {diff:?}",
            path.display(),
            x.len(),
            local.display(),
            y.len()
        );
    }
}

/// Every tensor of two local checkpoint directories, read whole, is bit-identical.
pub fn same_tensors(a: &Path, b: &Path) {
    let (ca, cb) = (Checkpoint::open(a).unwrap(), Checkpoint::open(b).unwrap());
    let keys: Vec<_> = ca.tensors().iter().map(|t| t.key.clone()).collect();
    assert_eq!(
        keys,
        cb.tensors()
            .iter()
            .map(|t| t.key.clone())
            .collect::<Vec<_>>()
    );
    for k in keys {
        assert!(
            ca.read_tensor(&k).unwrap() == cb.read_tensor(&k).unwrap(),
            "tensor `{k}` differs"
        );
    }
}

/// Runs `body` on S3: inside the child process, directly; else starts (once) the binary's
/// SeaweedFS and runs the test `test` (`module::path::s3`, from `module_path!()`) alone in a
/// child process of this binary with the `AWS_*` variables set, and fails with its output
/// unless it ran that one test and it passed. `ZARRCKPT_SKIP_S3=1` skips, saying so.
pub fn on_s3(module: &str, body: impl FnOnce(Target)) {
    if std::env::var_os(S3_CHILD).is_some() {
        return body(Target::S3);
    }
    // `module_path!()` begins with the test binary's crate name.
    let test = format!(
        "{}::s3",
        module.split_once("::").map_or(module, |(_, rest)| rest)
    );
    if s3::skipped(&test) {
        return;
    }
    let server = s3::shared();
    let out = Command::new(std::env::current_exe().expect("the test binary"))
        .args([test.as_str(), "--exact", "--nocapture", "--test-threads=1"])
        .envs(server.env())
        .env(S3_CHILD, server.endpoint())
        .output()
        .expect("run the test binary");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("test result: ok. 1 passed"),
        "{test} on S3 (child process, SeaweedFS at {}) failed:\n{text}",
        server.endpoint()
    );
}

/// Defines a test body `fn name(target: Target) { ... }` and tests running it: `name::local`,
/// `name::memory` and `name::s3` (see [`on_s3`]); a leading `[local, s3]` picks the variants
/// (`memory://` lives in this process only: a test whose body runs other processes on the
/// checkpoint has no `memory` variant). Doc comments and attributes go on the module.
#[macro_export]
macro_rules! on_targets {
    ([$($variant:ident),+] $(#[$meta:meta])* fn $name:ident($target:ident: Target) $body:block) => {
        $(#[$meta])*
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            use $crate::common::target::Target;

            fn body($target: Target) $body

            $($crate::on_targets!(@variant $variant);)+
        }
    };
    (@variant local) => {
        #[test]
        fn local() {
            body(Target::Local)
        }
    };
    (@variant memory) => {
        #[test]
        fn memory() {
            body(Target::Memory)
        }
    };
    (@variant s3) => {
        #[test]
        fn s3() {
            $crate::common::target::on_s3(module_path!(), body)
        }
    };
    ($(#[$meta:meta])* fn $name:ident($target:ident: Target) $body:block) => {
        $crate::on_targets!([local, memory, s3] $(#[$meta])* fn $name($target: Target) $body);
    };
}
