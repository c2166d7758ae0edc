//! Errors of model conversion: [`ConvertError`] (planning: defined in the plan layer and
//! re-exported here) and [`FormatError`] (reading or writing a model format).

pub use crate::plan::ConvertError;

/// Why reading or writing a model format (Hugging Face safetensors folders, vLLM per-rank
/// files, a Megatron-layout checkpoint) failed: each names the file and the tensor involved.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FormatError {
    /// The conversion was refused while planning (nothing was written).
    #[error(transparent)]
    Plan(#[from] ConvertError),
    /// The checkpoint could not be opened or read.
    #[error("checkpoint {path}: {source}")]
    Checkpoint {
        /// The checkpoint directory.
        path: std::path::PathBuf,
        /// The cause.
        #[source]
        source: Box<crate::Error>,
    },
    /// A file system call failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was done (`create`, `read`, `rename`, ...).
        op: &'static str,
        /// The path.
        path: std::path::PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A JSON file (config.json) does not parse.
    #[error("{path}: not JSON: {msg}")]
    Json {
        /// The file.
        path: std::path::PathBuf,
        /// The parser's message.
        msg: String,
    },
    /// A safetensors file does not parse.
    #[error("{path}: not a safetensors file: {msg}")]
    Safetensors {
        /// The file.
        path: std::path::PathBuf,
        /// The parser's message.
        msg: String,
    },
    /// A tensor whose data type safetensors (or zarrckpt) cannot represent.
    #[error("{path}: tensor `{tensor}` has data type {dtype}, which {msg}")]
    Dtype {
        /// The file.
        path: std::path::PathBuf,
        /// The tensor.
        tensor: String,
        /// The data type.
        dtype: String,
        /// Which side lacks it.
        msg: &'static str,
    },
    /// A safetensors header that cannot be written as asked (a size that does not match the
    /// shape, a repeated or reserved name, bytes that differ from the header's).
    #[error("{path}: tensor `{tensor}`: {msg}")]
    Header {
        /// The file.
        path: std::path::PathBuf,
        /// The tensor.
        tensor: String,
        /// What is wrong, with the numbers.
        msg: String,
    },
    /// The same tensor name in two files of one folder.
    #[error("tensor `{tensor}` appears in both {first} and {second}")]
    DuplicateTensor {
        /// The tensor.
        tensor: String,
        /// The first file.
        first: std::path::PathBuf,
        /// The second file.
        second: std::path::PathBuf,
    },
    /// A folder with no `.safetensors` file.
    #[error("{path}: no .safetensors files")]
    NoFiles {
        /// The folder.
        path: std::path::PathBuf,
    },
    /// No HF `config.json` was given or found.
    #[error(
        "no config.json: pass a config file or a folder to copy it from (a checkpoint written by an HF import holds its own)"
    )]
    NoConfig,
    /// The output directory holds files and replacing it was not asked for.
    #[error("{path} exists and is not empty (pass --overwrite to replace it)")]
    NotEmpty {
        /// The directory.
        path: std::path::PathBuf,
    },
    /// An option that does not parse or does not apply.
    #[error("{option}: {msg}")]
    Option {
        /// The option.
        option: &'static str,
        /// What is wrong.
        msg: String,
    },
    /// A DCP checkpoint (or one of its items) that this importer cannot read: a missing or
    /// malformed field, a range past the end of its file, a tensor view outside its storage,
    /// a value that is not plain data.
    #[error("{path}: `{item}`: {msg}")]
    Dcp {
        /// The file (or directory).
        path: std::path::PathBuf,
        /// The item (its state-dict key, or `.metadata`).
        item: String,
        /// What is wrong, with the numbers.
        msg: String,
    },
    /// A pickle refused by the restricted reader (nothing in it was run).
    #[error("{path}: `{item}`: {source}")]
    Pickle {
        /// The file.
        path: std::path::PathBuf,
        /// The item (its state-dict key, or `.metadata`).
        item: String,
        /// Why.
        #[source]
        source: super::pickle::PickleError,
    },
    /// A writer thread panicked (a bug): its files are incomplete.
    #[error("writer {index} of {writers} stopped unexpectedly; its files are incomplete")]
    Writer {
        /// The writer.
        index: usize,
        /// How many there were.
        writers: usize,
    },
}

impl FormatError {
    /// A closure turning an I/O error on `path` into [`FormatError::Io`].
    pub fn io(op: &'static str, path: &std::path::Path) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.to_owned();
        move |source| FormatError::Io { op, path, source }
    }

    /// A closure turning a checkpoint error on `path` into [`FormatError::Checkpoint`].
    pub fn ckpt(path: &std::path::Path) -> impl FnOnce(crate::Error) -> Self {
        let path = path.to_owned();
        move |source| FormatError::Checkpoint {
            path,
            source: Box::new(source),
        }
    }
}
