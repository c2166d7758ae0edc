//! `zarrckpt crash-trials --url s3://bucket/prefix`: the crash harness on an object store.
//! Each trial commits generation 1 at `<url>/trial-<i>`, starts a child that overwrites it
//! with generation 2 straight to the store (3 in-process ranks) and kills it with SIGKILL at a
//! random moment, then checks that the checkpoint at the URL is generation 1 or 2, loaded
//! bit-exactly and verified (never neither, never a mix), and that after the next overwrite
//! commits `gc` leaves only the committed generation. After each kill, `gc` (told that the
//! writer is dead) aborts the multipart uploads the killed save recorded and leaves no record. Endpoint and credentials come from the
//! environment (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, ...).

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, ensure};
use zarrckpt::remote::{self, RemoteStore};

use super::{Args, Kind, Rng, child, generation_of, save_generation, wait_ready};

fn open(url: &str) -> anyhow::Result<RemoteStore> {
    Ok(RemoteStore::open(url, &crate::remote::options())?)
}

/// Loads the checkpoint at `url` (fetched, every object checked against the manifest) and
/// returns its generation, one of `candidates`.
fn committed(url: &str, size: u64, candidates: &[u64]) -> anyhow::Result<u64> {
    let f = remote::fetch_url(url, &crate::remote::options(), None)
        .with_context(|| format!("{url}: neither the previous nor the new checkpoint loads"))?;
    generation_of(f.dir(), size, candidates)
}

/// The generations under `url` (committed or not).
fn generations(store: &RemoteStore) -> anyhow::Result<Vec<String>> {
    let mut g: Vec<String> = store
        .list("generations")?
        .into_iter()
        .filter_map(|(k, _)| {
            k.strip_prefix("generations/")
                .and_then(|r| r.split_once('/'))
                .map(|(g, _)| g.to_owned())
        })
        .collect();
    g.sort();
    g.dedup();
    Ok(g)
}

/// `gc` keeps only the committed generation.
fn collect(url: &str) -> anyhow::Result<usize> {
    let store = open(url)?;
    let r = remote::gc(&store, 1, false)?;
    let current = r.current.context("nothing committed")?;
    let left = generations(&store)?;
    ensure!(
        left == [current.clone()],
        "{url}: after gc the generations are {left:?}, expected only {current}"
    );
    Ok(r.removed.len())
}

#[derive(Default)]
struct Tally {
    passed: usize,
    new_committed: usize,
    old_kept: usize,
    finished: usize,
    collected: usize,
    uploads_aborted: usize,
}

fn trial(url: &str, size: u64, delay: Duration, tally: &mut Tally) -> anyhow::Result<()> {
    let path = std::path::Path::new(url);
    save_generation(Kind::Fresh, path, 1, size)?;
    let mut proc = child(Kind::Overwrite, path, 2, size).spawn()?;
    let _out = wait_ready(&mut proc)?;
    let finished = super::kill_after(&mut proc, delay)?;
    tally.finished += usize::from(finished);
    match committed(url, size, &[1, 2])? {
        2 => tally.new_committed += 1,
        _ => {
            ensure!(
                !finished,
                "the save returned success but the old checkpoint is there"
            );
            tally.old_kept += 1;
        }
    }
    // The killed save's generation is newer than the committed one when the old checkpoint
    // was kept: a plain gc leaves it (it cannot tell a dead writer from a live one); here the
    // writer is known dead, so gc takes every newer generation for abandoned and aborts the
    // multipart uploads it recorded. No upload record may be left.
    let store = open(url)?;
    let r = remote::gc_with(
        &store,
        &remote::GcOptions {
            abandoned_after: Some(Duration::ZERO),
            ..remote::GcOptions::default()
        },
    )?;
    tally.collected += r.removed.len();
    tally.uploads_aborted += r.uploads_aborted;
    let records: Vec<String> = store
        .list("generations")?
        .into_iter()
        .map(|(k, _)| k)
        .filter(|k| k.contains(&format!("/{}/", zarrckpt::storage::remote::UPLOADS)))
        .collect();
    ensure!(
        records.is_empty(),
        "{url}: upload records left after gc: {records:?}"
    );
    save_generation(Kind::Overwrite, path, 3, size)?;
    ensure!(committed(url, size, &[3])? == 3);
    tally.collected += collect(url)?;
    tally.passed += 1;
    Ok(())
}

/// Removes everything under `url` (the trial's prefix).
fn remove_all(url: &str) -> anyhow::Result<()> {
    let store = open(url)?;
    for (k, _) in store.list("")? {
        store.delete(&k)?;
    }
    Ok(())
}

pub(super) fn run(a: &Args, url: &str) -> anyhow::Result<ExitCode> {
    let url = url.trim_end_matches('/');
    // Calibrate: how long does an uninterrupted overwrite take?
    let cal = format!("{url}/calibrate");
    save_generation(Kind::Fresh, std::path::Path::new(&cal), 1, a.size)?;
    let full = super::calibrate(std::path::Path::new(&cal), a.size)?;
    remove_all(&cal)?;
    println!(
        "crash trials on {url}: {} trials, {} MiB per save, {} ranks, uninterrupted overwrite {:.1} ms (median of 5); kill uniformly in [0, 1x] of that",
        a.trials,
        a.size >> 20,
        super::WORLD,
        full.as_secs_f64() * 1e3
    );
    let mut rng = Rng(a.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut tally = Tally::default();
    let mut failures = 0usize;
    for i in 0..a.trials {
        let frac = (rng.next() % 1000) as f64 / 1000.0;
        let delay = full.mul_f64(frac);
        let t = format!("{url}/trial-{i}");
        if let Err(e) = trial(&t, a.size, delay, &mut tally) {
            println!(
                "FAIL trial {i} (kill at {:.1} ms): {e:#}",
                delay.as_secs_f64() * 1e3
            );
            failures += 1;
        }
        remove_all(&t)?;
    }
    println!(
        "passed {}/{} (new committed {}, previous kept {}, finished before the kill {}, generations removed by gc {}, recorded multipart uploads aborted by gc {})",
        tally.passed,
        a.trials,
        tally.new_committed,
        tally.old_kept,
        tally.finished,
        tally.collected,
        tally.uploads_aborted
    );
    Ok(if failures == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
