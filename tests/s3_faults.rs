//! Failures between the client and a real S3 server (SeaweedFS on loopback, see
//! `tests/common/s3.rs`), injected by a proxy on loopback (`tests/common/proxy.rs`, bounded in
//! count and time): transient `503 SlowDown`, `409` on conditional writes and dropped
//! connections (before the server saw the request, and after it acted on it) during a save and
//! a load still commit and read back bit-identical; a permanent failure of one rank's uploads
//! gives every rank an error naming that rank, the key and the HTTP status, within the
//! deadline the options set.

mod common;
#[path = "common/proxy.rs"]
mod proxy;

use std::time::{Duration, Instant};

use common::s3;
use common::state::{self, RankState};
use proxy::{Fault, Proxy, Rule};
use zarrckpt::comm::run_local;
use zarrckpt::remote::{self, RemoteOptions, RemoteStore, SaveTarget};
use zarrckpt::{Checkpoint, Communicator, SaveOptions, save};

/// Options reaching `endpoint` (the server or the proxy) with the test credentials, retrying
/// fast.
fn opts_for(endpoint: &str) -> RemoteOptions {
    RemoteOptions {
        max_retries: 20,
        init_backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(200),
        request_timeout: Duration::from_secs(20),
        retry_timeout: Duration::from_secs(30),
        ..s3::options_for(endpoint)
    }
}

/// Options straight to the server, once it answers signed requests.
fn direct_opts() -> RemoteOptions {
    opts_for(&s3::shared().endpoint())
}

fn s3_url(name: &str) -> String {
    format!("s3://{}/faults/{name}", s3::BUCKET)
}

fn save_state(
    url: &str,
    world: usize,
    step: u64,
    ropts: impl Fn(usize) -> RemoteOptions + Sync,
) -> Vec<zarrckpt::Result<String>> {
    let staging = tempfile::tempdir().unwrap();
    let target = SaveTarget {
        overwrite: false,
        staging_root: Some(staging.path().to_path_buf()),
    };
    run_local(world, Duration::from_secs(120), |comm| {
        let st = RankState::new(world as u64, comm.rank() as u64, step);
        remote::save_to_url(url, &comm, &ropts(comm.rank()), &target, |dir| {
            save(&st.sharded(), dir, &comm, &SaveOptions::default())
        })
        .map(|s| s.generation)
    })
}

/// The faults of a flaky server: every kind, a few times each, on writes and reads.
fn flaky_rules() -> Vec<Rule> {
    vec![
        Rule::new(Fault::SlowDown, 3, 4).method("PUT"),
        Rule::new(Fault::Conflict, 2, 3).method("PUT").conditional(),
        Rule::new(Fault::DropAfterForward, 3, 3)
            .method("PUT")
            .conditional(),
        Rule::new(Fault::DropBeforeForward, 4, 3).method("PUT"),
        Rule::new(Fault::Status(500), 5, 2).method("POST"),
        Rule::new(Fault::DropAfterForward, 1, 1)
            .method("POST")
            .path("uploadId="),
        Rule::new(Fault::SlowDown, 3, 4).method("GET"),
        Rule::new(Fault::DropBeforeForward, 4, 3).method("GET"),
        Rule::new(Fault::SlowDown, 2, 2).method("HEAD"),
    ]
}

fn faults_seen(p: &Proxy) -> Vec<String> {
    let mut kinds: Vec<String> = p
        .log()
        .iter()
        .map(|l| {
            l.split(' ').next().unwrap_or_default().to_string()
                + " "
                + l.rsplit("-> ").next().unwrap_or_default()
        })
        .collect();
    kinds.sort();
    kinds.dedup();
    kinds
}

fn save_and_load_through_faults(name: &str, multipart: bool) {
    let direct = direct_opts();
    let proxy = Proxy::start(s3::shared().port, flaky_rules(), Duration::from_secs(300));
    let ropts = RemoteOptions {
        // Every object a multipart upload of one part, or none.
        multipart_threshold: if multipart { 1 } else { u64::MAX },
        ..opts_for(&proxy.endpoint())
    };
    let url = s3_url(name);
    for r in save_state(&url, 2, 7, |_| ropts.clone()) {
        r.unwrap();
    }
    let fetched = remote::fetch_url(&url, &ropts, None).unwrap();
    let seen = faults_seen(&proxy);
    let local = tempfile::tempdir().unwrap();
    let dir = local.path().join("ckpt");
    run_local(2, Duration::from_secs(60), |comm| {
        let st = RankState::new(2, comm.rank() as u64, 7);
        save(&st.sharded(), &dir, &comm, &SaveOptions::default()).unwrap();
    });
    state::check(fetched.dir(), 7);
    common::target::same_tensors(fetched.dir(), &dir);
    let report = Checkpoint::open(fetched.dir())
        .unwrap()
        .verify(2, None)
        .unwrap();
    assert!(
        report.problems.is_empty() && report.chunks > 0,
        "{:?}",
        report.problems
    );
    // The faults were there (the proxy's rules matched), and the committed checkpoint reads
    // the same straight from the server.
    for want in [
        "PUT SlowDown",
        "PUT Conflict",
        "PUT DropAfterForward",
        "PUT DropBeforeForward",
        "GET SlowDown",
        "GET DropBeforeForward",
    ] {
        assert!(
            seen.iter().any(|s| s == want),
            "no `{want}` injected: {:?}",
            proxy.log()
        );
    }
    if multipart {
        assert!(
            seen.iter().any(|s| s == "POST DropAfterForward"),
            "no completion dropped: {:?}",
            proxy.log()
        );
    }
    let again = remote::fetch_url(&url, &direct, None).unwrap();
    common::target::same_tensors(again.dir(), &dir);
}

#[test]
fn transient_503_409_and_drops_still_commit_and_read_back_bit_identical() {
    if s3::skipped("transient_503_409_and_drops_still_commit_and_read_back_bit_identical") {
        return;
    }
    save_and_load_through_faults("transient-single", false);
}

#[test]
fn transient_faults_on_multipart_uploads_still_commit() {
    if s3::skipped("transient_faults_on_multipart_uploads_still_commit") {
        return;
    }
    save_and_load_through_faults("transient-multipart", true);
}

#[test]
fn a_rank_whose_uploads_fail_for_good_is_named_on_every_rank_within_the_deadline() {
    if s3::skipped("a_rank_whose_uploads_fail_for_good_is_named_on_every_rank_within_the_deadline")
    {
        return;
    }
    let direct = direct_opts();
    // Rank 1 reaches the server through a proxy that answers every upload into a generation
    // with 503 SlowDown, for good; the others reach it directly.
    let proxy = Proxy::start(
        s3::shared().port,
        vec![
            Rule::new(Fault::SlowDown, 1, u64::MAX)
                .method("PUT")
                .path("/generations/"),
        ],
        Duration::from_secs(300),
    );
    let deadline = Duration::from_secs(3);
    let broken = RemoteOptions {
        retry_timeout: deadline,
        max_retries: 1000,
        ..opts_for(&proxy.endpoint())
    };
    let url = s3_url("permanent");
    let world = 3;
    let start = Instant::now();
    let results = save_state(&url, world, 1, |rank| {
        if rank == 1 {
            broken.clone()
        } else {
            direct.clone()
        }
    });
    let took = start.elapsed();
    assert!(proxy.injected() > 1, "{:?}", proxy.log());
    // Within the deadline: one request's retry budget, its last try, and the collective.
    assert!(
        took < deadline + Duration::from_secs(20),
        "the save took {took:?} with a retry deadline of {deadline:?}"
    );
    // Nothing committed.
    let store = RemoteStore::open(&url, &direct).unwrap();
    s3::assert_failure_named(&results, 1, &url, "503", &store);
}

#[test]
fn the_storage_seam_settles_conditional_puts_whose_answer_was_lost() {
    use zarrckpt::storage::StorageError;
    use zarrckpt::storage::store::Store;
    if s3::skipped("the_storage_seam_settles_conditional_puts_whose_answer_was_lost") {
        return;
    }
    let _ = direct_opts();
    // Every conditional PUT's answer is lost once (the server acts on it), and a 409 comes
    // before one of them: each put still reports what happened on the server.
    let proxy = Proxy::start(
        s3::shared().port,
        vec![
            Rule::new(Fault::Conflict, 3, 1).method("PUT").conditional(),
            Rule::new(Fault::DropAfterForward, 1, 3)
                .method("PUT")
                .conditional(),
        ],
        Duration::from_secs(120),
    );
    let s = RemoteStore::open(&s3_url("seam"), &opts_for(&proxy.endpoint())).unwrap();
    let first = Store::put_if_absent(&s, "k", &[b"mine"]).unwrap();
    assert!(matches!(
        Store::put_if_absent(&s, "k", &[b"theirs"]),
        Err(StorageError::ObjectExists { .. })
    ));
    let etag = Store::head(&s, "k").unwrap().e_tag;
    assert!(first.e_tag.is_none() || first.e_tag == etag);
    Store::put_if_match(&s, "k", &[b"next"], &first.update_version()).unwrap();
    assert!(matches!(
        Store::put_if_match(&s, "k", &[b"late"], &first.update_version()),
        Err(StorageError::Precondition { .. })
    ));
    let log = proxy.log();
    assert!(
        log.iter()
            .filter(|l| l.ends_with("DropAfterForward"))
            .count()
            == 3
            && log.iter().any(|l| l.ends_with("Conflict")),
        "{log:?}"
    );
    let whole = [0..4u64, 0..4];
    assert_eq!(
        Store::get_ranges(&s, "k", &whole).unwrap(),
        vec![b"next".to_vec(), b"next".to_vec()]
    );
}
