//! Uploads of local files into a generation (the staged save): one PUT below the multipart
//! threshold, else a multipart upload recorded while open ([`super::multipart`]), looking for
//! other ranks' abort markers before the object and between its parts ([`super::abort`]).

use std::io::Read;
use std::path::Path;

use bytes::Bytes;
use object_store::{PutMode, WriteMultipart};

use super::abort::AbortWatch;
use super::client::{PutOutcome, RemoteStore};
use super::error::RemoteError;
use super::multipart::RecordedUpload;

impl RemoteStore {
    /// Uploads the local file `src` as `key`: one PUT (if-absent unless
    /// `allow_unconditional`) below the multipart threshold, else a multipart upload of
    /// `part_size` parts with at most `parts_in_flight` in flight, read from the file as they
    /// go (memory: about `parts_in_flight x part_size`), recorded while open when `key` is in
    /// a generation (see [`super::multipart`]). Returns `(size, crc32c)` of what was sent. A
    /// failed multipart upload is aborted.
    ///
    /// # Errors
    /// [`RemoteError::Io`] reading `src`; [`RemoteError::Request`] naming the key;
    /// [`RemoteError::Corrupt`] when the key exists already (a generation key reused).
    pub async fn upload_file(&self, key: &str, src: &Path) -> Result<(u64, u32), RemoteError> {
        self.upload_file_watched(key, src, None, None).await
    }

    /// [`RemoteStore::upload_file`] for rank `rank` of a save, looking at `watch` (another
    /// rank's abort marker) before the object and between its parts.
    ///
    /// # Errors
    /// As [`RemoteStore::upload_file`], and [`RemoteError::Abandoned`] when `watch` finds
    /// another rank's marker.
    pub async fn upload_file_watched(
        &self,
        key: &str,
        src: &Path,
        watch: Option<&AbortWatch>,
        rank: Option<usize>,
    ) -> Result<(u64, u32), RemoteError> {
        if let Some(w) = watch {
            w.check().await?;
        }
        let size = std::fs::metadata(src)
            .map_err(|e| RemoteError::io(src, e))?
            .len();
        let path = self.path(key);
        if size < self.options().multipart_threshold {
            let data = tokio::task::block_in_place(|| std::fs::read(src))
                .map_err(|e| RemoteError::io(src, e))?;
            let crc = crc32c::crc32c(&data);
            let len = data.len() as u64;
            let mode = if self.options().allow_unconditional {
                PutMode::Overwrite
            } else {
                PutMode::Create
            };
            match self
                .put_resolved(&path, Bytes::from(data), mode)
                .await
                .map_err(self.err("PUT", key))?
            {
                PutOutcome::Written(_) => Ok((len, crc)),
                PutOutcome::Exists | PutOutcome::Changed => Err(RemoteError::Corrupt {
                    key: self.url().url_of(key),
                    detail: "the object exists already: a generation key was reused".into(),
                }),
            }
        } else if let Some(mut up) = RecordedUpload::begin(self, key, rank).await? {
            match self.stream_recorded(&mut up, src, watch).await {
                Ok((len, crc)) => up.finish().await.map(|_| (len, crc)),
                Err(e) => {
                    up.abort().await;
                    Err(e)
                }
            }
        } else {
            let upload = self
                .inner()
                .put_multipart(&path)
                .await
                .map_err(self.err("multipart PUT", key))?;
            let part = self.options().part_size.max(5 << 20);
            let mut w = WriteMultipart::new_with_chunk_size(upload, part);
            match self.stream_parts(&mut w, src, part).await {
                Ok((len, crc)) => match w.finish().await {
                    Ok(_) => Ok((len, crc)),
                    // The completion's answer was lost and its retry found the upload gone
                    // (completed by the first try): the object is there with every byte.
                    // The key is fresh in this save's generation, so only this upload
                    // can have written it.
                    Err(e) => match self.inner().head(&path).await {
                        Ok(m) if m.size == len => Ok((len, crc)),
                        _ => Err(self.err("multipart PUT", key)(e)),
                    },
                },
                Err(e) => {
                    let _ = w.abort().await;
                    Err(e)
                }
            }
        }
    }

    async fn stream_recorded(
        &self,
        up: &mut RecordedUpload,
        src: &Path,
        watch: Option<&AbortWatch>,
    ) -> Result<(u64, u32), RemoteError> {
        let mut parts = FileParts::open(src, self.options().part_size.max(5 << 20))?;
        loop {
            if let Some(w) = watch {
                w.check().await?;
            }
            let Some(part) = parts.next()? else { break };
            up.write(part).await?;
        }
        Ok(parts.totals())
    }

    async fn stream_parts(
        &self,
        w: &mut WriteMultipart,
        src: &Path,
        part: usize,
    ) -> Result<(u64, u32), RemoteError> {
        let mut parts = FileParts::open(src, part)?;
        loop {
            w.wait_for_capacity(self.options().parts_in_flight.max(1).saturating_sub(1))
                .await
                .map_err(|e| RemoteError::Request {
                    op: "multipart PUT",
                    key: src.display().to_string(),
                    source: e,
                })?;
            let Some(part) = parts.next()? else { break };
            w.write(part);
        }
        Ok(parts.totals())
    }
}

/// A local file read a part at a time into one reused buffer, its length and crc32c summed
/// as it goes.
struct FileParts<'p> {
    src: &'p Path,
    f: std::fs::File,
    buf: Vec<u8>,
    len: u64,
    crc: u32,
}

impl<'p> FileParts<'p> {
    fn open(src: &'p Path, part: usize) -> Result<Self, RemoteError> {
        Ok(FileParts {
            src,
            f: std::fs::File::open(src).map_err(|e| RemoteError::io(src, e))?,
            buf: vec![0u8; part.max(1)],
            len: 0,
            crc: 0,
        })
    }

    /// The next part (full unless it is the last), `None` at the end of the file. Reads on
    /// the runtime's blocking allowance.
    fn next(&mut self) -> Result<Option<&[u8]>, RemoteError> {
        let n = tokio::task::block_in_place(|| read_full(&mut self.f, &mut self.buf))
            .map_err(|e| RemoteError::io(self.src, e))?;
        if n == 0 {
            return Ok(None);
        }
        let part = &self.buf[..n];
        self.crc = crc32c::crc32c_append(self.crc, part);
        self.len += n as u64;
        Ok(Some(part))
    }

    /// (bytes, crc32c) of what was read.
    fn totals(&self) -> (u64, u32) {
        (self.len, self.crc)
    }
}

fn read_full(f: &mut std::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}
