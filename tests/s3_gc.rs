//! `gc` and early abort against a real S3 server (SeaweedFS on loopback, `tests/common/s3.rs`):
//! - a save killed (SIGKILL, the crash harness's child) in the middle of its multipart uploads
//!   leaves them open on the server; `gc` finds them through their upload records and aborts
//!   them: the server's own ListMultipartUploads (a SigV4-signed request) then lists none;
//! - a rank whose uploads fail for good stops the other ranks early: the bytes they sent
//!   (counted at a proxy in front of them) are a small part of what they had to upload.

#[path = "common/proxy.rs"]
mod proxy;
#[path = "common/s3.rs"]
mod s3_server;

use std::io::{Read, Write};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use proxy::{Fault, Proxy, Rule};
use zarrckpt::remote::{GcOptions, RemoteError, RemoteOptions, RemoteStore, gc_with};
use zarrckpt::storage::remote::{GenerationWriter, UPLOADS, UploadRecord};
use zarrckpt::storage::store::Store;

fn server() -> &'static s3_server::S3Server {
    static SERVER: OnceLock<s3_server::S3Server> = OnceLock::new();
    SERVER.get_or_init(s3_server::S3Server::start)
}

fn opts_for(endpoint: &str) -> RemoteOptions {
    RemoteOptions {
        config: vec![
            ("aws_endpoint".into(), endpoint.into()),
            ("aws_access_key_id".into(), s3_server::ACCESS_KEY.into()),
            ("aws_secret_access_key".into(), s3_server::SECRET_KEY.into()),
            ("aws_region".into(), "us-east-1".into()),
            ("aws_allow_http".into(), "true".into()),
        ],
        max_retries: 20,
        init_backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(200),
        request_timeout: Duration::from_secs(20),
        retry_timeout: Duration::from_secs(30),
        ..RemoteOptions::builtin()
    }
}

/// Options straight to the server, once it answers signed requests.
fn direct_opts() -> RemoteOptions {
    static READY: OnceLock<()> = OnceLock::new();
    let opts = opts_for(&server().endpoint());
    READY.get_or_init(|| {
        let store = RemoteStore::open(&format!("s3://{}/ready", s3_server::BUCKET), &opts).unwrap();
        let start = Instant::now();
        while let Err(e) = store.list("") {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "SeaweedFS answers no signed LIST after 60 s: {e}\n{}",
                server().log()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    });
    opts
}

/// The server's open multipart uploads (ListMultipartUploads, signed with `object_store`'s
/// SigV4 signer, sent over a plain socket): `(key, upload id)` of those under `prefix`.
fn open_uploads(prefix: &str) -> Vec<(String, String)> {
    use object_store::aws::{AwsAuthorizer, AwsCredential};
    use object_store::client::{HttpRequest, HttpRequestBody};
    let port = server().port;
    let target = format!("/{}?uploads", s3_server::BUCKET);
    let mut req = HttpRequest::new(HttpRequestBody::empty());
    *req.uri_mut() = format!("http://127.0.0.1:{port}{target}").parse().unwrap();
    let cred = AwsCredential {
        key_id: s3_server::ACCESS_KEY.into(),
        secret_key: s3_server::SECRET_KEY.into(),
        token: None,
    };
    AwsAuthorizer::new(&cred, "s3", "us-east-1").authorize(&mut req, None);
    let mut text = format!("GET {target} HTTP/1.0\r\n");
    for (k, v) in req.headers() {
        text.push_str(&format!("{}: {}\r\n", k.as_str(), v.to_str().unwrap()));
    }
    text.push_str("Connection: close\r\n\r\n");
    let mut sock = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    sock.write_all(text.as_bytes()).unwrap();
    let mut answer = String::new();
    sock.read_to_string(&mut answer).unwrap();
    assert!(
        answer.starts_with("HTTP/1.1 200") || answer.starts_with("HTTP/1.0 200"),
        "ListMultipartUploads: {answer}"
    );
    let field = |s: &str, tag: &str| -> Option<String> {
        let (_, rest) = s.split_once(&format!("<{tag}>"))?;
        Some(rest.split_once(&format!("</{tag}>"))?.0.to_string())
    };
    answer
        .split("<Upload>")
        .skip(1)
        .filter_map(|u| Some((field(u, "Key")?, field(u, "UploadId")?)))
        .filter(|(k, _)| k.trim_start_matches('/').starts_with(prefix))
        .collect()
}

#[test]
fn gc_aborts_the_multipart_uploads_a_killed_save_left_open() {
    if s3_server::skipped("gc_aborts_the_multipart_uploads_a_killed_save_left_open") {
        return;
    }
    let direct = direct_opts();
    // The save's second parts never land (503 for good), so it is killed mid-multipart with
    // its first parts stored on the server.
    let proxy = Proxy::start(
        server().port,
        vec![
            Rule::new(Fault::SlowDown, 1, u64::MAX)
                .method("PUT")
                .path("partNumber=2"),
        ],
        Duration::from_secs(300),
    );
    let prefix = "gc/killed";
    let url = format!("s3://{}/{prefix}", s3_server::BUCKET);
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_zarrckpt"))
        .args(["crash-child", "fresh", "--dir", &url, "--generation", "1"])
        .args(["--size", &(96u64 << 20).to_string()])
        .env("AWS_ENDPOINT_URL", proxy.endpoint())
        .env("AWS_ACCESS_KEY_ID", s3_server::ACCESS_KEY)
        .env("AWS_SECRET_ACCESS_KEY", s3_server::SECRET_KEY)
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ALLOW_HTTP", "true")
        .env(
            "ZARRCKPT_REMOTE_MULTIPART_THRESHOLD",
            (5u64 << 20).to_string(),
        )
        .env("ZARRCKPT_REMOTE_PART_SIZE", (5u64 << 20).to_string())
        .env("ZARRCKPT_REMOTE_MAX_RETRIES", "100000")
        .env("ZARRCKPT_REMOTE_RETRY_TIMEOUT", "3600")
        .env("ZARRCKPT_REMOTE_BACKOFF_MAX", "0.2")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let store = RemoteStore::open(&url, &direct).unwrap();
    let records = || -> Vec<String> {
        store
            .list("generations")
            .unwrap()
            .into_iter()
            .map(|(k, _)| k)
            .filter(|k| k.contains(&format!("/{UPLOADS}/")))
            .collect()
    };
    let t0 = Instant::now();
    while proxy.injected() < 20 || records().len() < 3 {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "the save never got stuck mid-multipart: {} faults, records {:?}",
            proxy.injected(),
            records()
        );
        assert!(child.try_wait().unwrap().is_none(), "the save ended");
        std::thread::sleep(Duration::from_millis(50));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let left = open_uploads(prefix);
    let recorded: Vec<UploadRecord> = records()
        .iter()
        .map(|k| serde_json::from_slice(&store.get(k).unwrap().unwrap().0).unwrap())
        .collect();
    // Real leftovers on the server, every one of them recorded.
    assert!(left.len() >= 3, "open uploads after the kill: {left:?}");
    for (key, id) in &left {
        assert!(
            recorded
                .iter()
                .any(|r| &r.upload_id == id && key.ends_with(&r.key)),
            "the open upload {key} {id} has no record: {recorded:?}"
        );
    }
    // A plain gc cannot tell the killed save from a live one: it leaves them.
    let plain = gc_with(&store, &GcOptions::default()).unwrap();
    assert_eq!(plain.uploads_aborted, 0);
    assert_eq!(open_uploads(prefix).len(), left.len());
    // Told that the writer is dead, gc aborts them all and removes the generation.
    let r = gc_with(
        &store,
        &GcOptions {
            abandoned_after: Some(Duration::ZERO),
            ..GcOptions::default()
        },
    )
    .unwrap();
    assert_eq!(r.uploads_aborted, recorded.len(), "{r:?}");
    assert_eq!(r.removed.len(), 1, "{r:?}");
    assert_eq!(open_uploads(prefix), Vec::new());
    assert!(store.list("generations").unwrap().is_empty());
}

#[test]
fn a_rank_whose_uploads_fail_for_good_stops_the_others_before_they_upload_their_share() {
    if s3_server::skipped(
        "a_rank_whose_uploads_fail_for_good_stops_the_others_before_they_upload_their_share",
    ) {
        return;
    }
    let _ = direct_opts();
    // Rank 1 reaches the server through a proxy answering every object upload with 503 for
    // good (its abort marker still gets through); ranks 0 and 2 through a proxy that only
    // counts their bytes.
    let failing = Proxy::start(
        server().port,
        vec![
            Rule::new(Fault::SlowDown, 1, u64::MAX)
                .method("PUT")
                .path("/tensors/"),
        ],
        Duration::from_secs(300),
    );
    let counting = Proxy::start(server().port, Vec::new(), Duration::from_secs(300));
    let check = Duration::from_millis(100);
    let broken = RemoteOptions {
        max_retries: 2,
        retry_timeout: Duration::from_secs(1),
        abort_check_interval: check,
        ..opts_for(&failing.endpoint())
    };
    let healthy = RemoteOptions {
        abort_check_interval: check,
        ..opts_for(&counting.endpoint())
    };
    let url = format!("s3://{}/gc/early-abort", s3_server::BUCKET);
    let generation = format!(
        "{:013}-early",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis()
    );
    const OBJECTS: usize = 1000;
    const SIZE: usize = 256 << 10;
    let planned = (2 * OBJECTS * SIZE) as u64;
    let results: Vec<Result<usize, zarrckpt::storage::StorageError>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..3usize)
            .map(|rank| {
                let opts = if rank == 1 { &broken } else { &healthy };
                let (url, generation) = (&url, &generation);
                s.spawn(move || {
                    let store = RemoteStore::open(url, opts).unwrap();
                    let w = GenerationWriter::new(&store, generation, None).with_rank(rank);
                    let data = vec![rank as u8; SIZE];
                    for i in 0..OBJECTS {
                        Store::put(&w, &format!("tensors/r{rank}/c/{i}"), &[data.as_slice()])?;
                    }
                    Ok(OBJECTS)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let sent = counting.put_bytes();
    println!(
        "healthy ranks sent {sent} of {planned} bytes ({:.1} %) before stopping",
        sent as f64 * 100.0 / planned as f64
    );
    assert!(failing.injected() > 1, "{:?}", failing.log());
    for (rank, r) in results.iter().enumerate() {
        let e = r.as_ref().expect_err("every rank fails");
        let text = e.to_string();
        let source = std::error::Error::source(e)
            .map(ToString::to_string)
            .unwrap_or_default();
        assert!(
            text.contains(&format!("{url}/generations/")),
            "rank {rank}: {text}"
        );
        if rank != 1 {
            let abandoned = match e {
                zarrckpt::storage::StorageError::Io { source, .. } => source
                    .get_ref()
                    .and_then(|s| s.downcast_ref::<RemoteError>())
                    .map(|r| {
                        matches!(
                            r,
                            RemoteError::Abandoned {
                                rank: Some(1),
                                status: Some(503),
                                ..
                            }
                        )
                    })
                    .unwrap_or(false),
                _ => false,
            };
            assert!(abandoned, "rank {rank}: {text}: {source}");
            assert!(source.contains("/tensors/r1/c/0"), "rank {rank}: {source}");
        }
    }
    // The healthy ranks stopped well before finishing: under a quarter of their share went out.
    assert!(
        sent < planned / 4,
        "the healthy ranks sent {sent} of {planned} bytes"
    );
    let store = RemoteStore::open(&url, &direct_opts()).unwrap();
    let markers = store
        .list(&format!("generations/{generation}/abort"))
        .unwrap();
    assert_eq!(markers.len(), 1, "{markers:?}");
    assert!(markers[0].0.ends_with("/abort/1"), "{markers:?}");
    // gc knows the failed save for dead (its marker) and removes it without being told.
    let r = gc_with(&store, &GcOptions::default()).unwrap();
    assert_eq!(r.removed, vec![generation.clone()]);
}
