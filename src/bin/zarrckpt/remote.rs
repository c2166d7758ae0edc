//! Object-store URLs in the CLI (`s3://bucket/prefix`, `gs://`, `az://`): commands that read a
//! checkpoint fetch its committed generation into a temporary directory first (every object
//! checked against the manifest's size and crc32c); `zarrckpt cp` copies a checkpoint between
//! a directory and a URL (a new generation and a pointer move); `zarrckpt gc` removes old
//! generations. Endpoint, region and credentials come from the usual environment variables
//! (`AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
//! `AWS_ALLOW_HTTP=true` for a plain-HTTP endpoint; `GOOGLE_*`, `AZURE_*`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use zarrckpt::remote::{self, RemoteOptions, RemoteStore, SaveTarget};

/// A checkpoint argument made local: a directory as given, or a fetched generation (removed
/// when this is dropped).
pub struct Local {
    path: PathBuf,
    _fetched: Option<remote::Fetched>,
}

impl Local {
    /// The local directory.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Options from the environment: `ZARRCKPT_ALLOW_UNCONDITIONAL_WRITES=1` allows a server that
/// ignores conditional writes.
pub fn options() -> RemoteOptions {
    RemoteOptions {
        allow_unconditional: std::env::var("ZARRCKPT_ALLOW_UNCONDITIONAL_WRITES").as_deref()
            == Ok("1"),
        ..RemoteOptions::default()
    }
}

/// `p` itself when it is a local path; else the checkpoint at the URL, fetched.
pub fn local(p: &Path) -> anyhow::Result<Local> {
    let s = p.to_string_lossy();
    if !remote::is_url(&s) {
        return Ok(Local {
            path: p.to_path_buf(),
            _fetched: None,
        });
    }
    let fetched = remote::fetch_url(&s, &options(), None)?;
    let r = fetched.resolved();
    eprintln!(
        "{s}: generation {} ({} objects, {:.3} GB) fetched",
        r.generation,
        r.manifest.objects.len(),
        r.bytes() as f64 / 1e9
    );
    Ok(Local {
        path: fetched.dir().to_path_buf(),
        _fetched: Some(fetched),
    })
}

/// Arguments of `zarrckpt cp`.
#[derive(clap::Args)]
pub struct CpArgs {
    /// A committed checkpoint: a directory or a URL.
    src: PathBuf,
    /// Where to: a URL (committed as a new generation) or a directory that must not exist.
    dst: PathBuf,
    /// Replace the checkpoint committed at the destination URL.
    #[arg(long)]
    overwrite: bool,
}

fn copy_tree(src: &Path, dst: &Path) -> std::io::Result<u64> {
    std::fs::create_dir_all(dst)?;
    let mut n = 0;
    for e in std::fs::read_dir(src)? {
        let e = e?;
        let to = dst.join(e.file_name());
        if e.file_type()?.is_dir() {
            n += copy_tree(&e.path(), &to)?;
        } else {
            n += std::fs::copy(e.path(), &to)?;
        }
    }
    Ok(n)
}

pub fn cp(a: &CpArgs) -> anyhow::Result<ExitCode> {
    let src = local(&a.src)?;
    // Only committed checkpoints are copied.
    zarrckpt::Checkpoint::open(src.path())?;
    let dst = a.dst.to_string_lossy();
    if remote::is_url(&dst) {
        let comm = zarrckpt::LocalComm::single();
        let target = SaveTarget {
            overwrite: a.overwrite,
            staging_root: None,
        };
        let saved = remote::save_to_url(&dst, &comm, &options(), &target, |dir| {
            copy_tree(src.path(), dir).map_err(|e| zarrckpt::Error::RemoteFailure {
                rank: 0,
                message: format!("copying {} to {}: {e}", src.path().display(), dir.display()),
            })
        })?;
        println!(
            "{dst}: committed generation {} ({} objects, {:.3} GB)",
            saved.generation,
            saved.objects + 1,
            saved.bytes as f64 / 1e9
        );
    } else {
        anyhow::ensure!(!a.dst.exists(), "{}: exists already", a.dst.display());
        let n = copy_tree(src.path(), &a.dst)?;
        println!("{}: {:.3} GB copied", a.dst.display(), n as f64 / 1e9);
    }
    Ok(ExitCode::SUCCESS)
}

/// Arguments of `zarrckpt gc`.
#[derive(clap::Args)]
pub struct GcArgs {
    /// The checkpoint URL.
    url: String,
    /// Committed generations to keep, the current one included.
    #[arg(long, default_value_t = 1)]
    keep: usize,
    /// Only print what would be removed.
    #[arg(long)]
    dry_run: bool,
    /// Also remove generations newer than the committed one whose id is at least this many
    /// seconds old (saves killed before they committed), aborting their recorded multipart
    /// uploads. Only safe when no save of this checkpoint that started that long ago can still
    /// be running. Without it such generations stay unless their save failed (abort marker).
    #[arg(long, value_name = "SECS")]
    abandoned_after: Option<f64>,
}

pub fn gc(a: &GcArgs) -> anyhow::Result<ExitCode> {
    let store = RemoteStore::open(&a.url, &options())?;
    let abandoned_after = a
        .abandoned_after
        .map(|s| {
            std::time::Duration::try_from_secs_f64(s)
                .map_err(|_| anyhow::anyhow!("--abandoned-after {s}: not a number of seconds"))
        })
        .transpose()?;
    let r = remote::gc_with(
        &store,
        &remote::GcOptions {
            keep: a.keep.max(1),
            dry_run: a.dry_run,
            abandoned_after,
        },
    )?;
    let verb = if a.dry_run { "would remove" } else { "removed" };
    match &r.current {
        Some(c) => println!("{}: committed generation {c}; kept {:?}", a.url, r.kept),
        None => println!(
            "{}: no committed generation; nothing is known to be old",
            a.url
        ),
    }
    println!(
        "{verb} {} generation(s), {} object(s), {:.3} GB: {:?}",
        r.removed.len(),
        r.objects,
        r.bytes as f64 / 1e9,
        r.removed
    );
    let verb = if a.dry_run { "would abort" } else { "aborted" };
    println!(
        "{verb} {} recorded multipart upload(s) left open",
        r.uploads_aborted
    );
    Ok(ExitCode::SUCCESS)
}

/// `zarrckpt ls URL`: the checkpoints (prefixes with a pointer) directly under a URL, or the
/// one at the URL itself.
pub fn ls(url: &str) -> anyhow::Result<ExitCode> {
    let store = RemoteStore::open(url, &options())?;
    println!(
        "{:<40}  {:<32}  {:>8}  {:>12}",
        "checkpoint", "generation", "objects", "bytes"
    );
    let mut found = 0;
    let mut show = |u: &str| -> anyhow::Result<()> {
        let s = RemoteStore::open(u, &options())?;
        if let Ok(r) = remote::resolve(&s) {
            println!(
                "{u:<40}  {:<32}  {:>8}  {:>12}",
                r.generation,
                r.manifest.objects.len(),
                r.bytes()
            );
            found += 1;
        }
        Ok(())
    };
    show(url)?;
    for child in store.list_children()? {
        show(&store.url().url_of(&child))?;
    }
    println!("{found} checkpoint(s) under {url}");
    Ok(ExitCode::SUCCESS)
}
