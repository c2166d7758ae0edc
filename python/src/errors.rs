//! zarrckpt errors as Python exceptions: the crate's full message (key, chunk, rank, path),
//! a class per kind of failure (defined in `zarrckpt/_errors.py`), the variant's name in
//! `kind`, and the ranks, keys and path where the error names them. A failure of the Python
//! communicator travels through zarrckpt as a communication error and comes back chained
//! (`__cause__`) to the original Python exception.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use zarrckpt::Error;

use crate::comm::PyComm;

/// The Python class and the variant name for an error.
fn class_and_kind(e: &Error) -> (&'static str, &'static str) {
    match e {
        Error::Tensor(_) => ("InvalidArgumentError", "Tensor"),
        Error::Key(_) => ("InvalidArgumentError", "Key"),
        Error::Object(_) => ("InvalidArgumentError", "Object"),
        Error::State(_) => ("InvalidArgumentError", "State"),
        Error::InconsistentPieces { .. } => ("PlanError", "InconsistentPieces"),
        Error::Plan(_) => ("PlanError", "Plan"),
        Error::Limit(_) => ("PlanError", "Limit"),
        Error::Layout(_) => ("PlanError", "Layout"),
        Error::ObjectPlan(_) => ("PlanError", "ObjectPlan"),
        Error::Comm(_) => ("CommError", "Comm"),
        Error::RemoteFailure { .. } => ("CommError", "RemoteFailure"),
        Error::Storage(_) => ("StorageError", "Storage"),
        Error::StorageNotShared { .. } => ("StorageError", "StorageNotShared"),
        Error::UnexpectedKeys { .. } => ("KeyMismatchError", "UnexpectedKeys"),
        Error::MissingKeys { .. } => ("KeyMismatchError", "MissingKeys"),
        Error::DtypeMismatch { .. } => ("MismatchError", "DtypeMismatch"),
        Error::ShapeMismatch { .. } => ("MismatchError", "ShapeMismatch"),
        Error::ObjectScopeMismatch { .. } => ("MismatchError", "ObjectScopeMismatch"),
        Error::ObjectRankMissing { .. } => ("MismatchError", "ObjectRankMissing"),
        Error::ObjectGridMismatch { .. } => ("MismatchError", "ObjectGridMismatch"),
        Error::SaveInFlight { .. } => ("SaveError", "SaveInFlight"),
        Error::Background { .. } => ("SaveError", "Background"),
        Error::ThreadPool(_) => ("SaveError", "ThreadPool"),
        Error::Convert(_) => ("PlanError", "Convert"),
        _ => ("ZarrckptError", "Other"),
    }
}

/// The message: the error's own text, then each cause its text does not already include.
pub(crate) fn message(e: &dyn std::error::Error) -> String {
    let mut msg = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !msg.contains(&text) {
            msg.push_str(": ");
            msg.push_str(&text);
        }
        source = s.source();
    }
    msg
}

/// Converts a zarrckpt error into the Python exception to raise. `comm` is the Python
/// communicator of the call, whose recorded failure (if any) becomes the `__cause__`.
pub(crate) fn to_py(py: Python<'_>, e: &Error, comm: Option<&PyComm>) -> PyErr {
    match build(py, e, comm) {
        Ok(err) => err,
        // The exception classes could not be built: still raise the message.
        Err(_) => PyRuntimeError::new_err(message(e)),
    }
}

/// A Python exception of class `class` (of `zarrckpt._errors`) with `kind` and `message`.
pub(crate) fn new_error(py: Python<'_>, class: &str, kind: &str, message: String) -> PyErr {
    let build = || -> PyResult<PyErr> {
        let exc = py
            .import("zarrckpt._errors")?
            .getattr(class)?
            .call1((message.clone(),))?;
        exc.setattr("kind", kind)?;
        exc.setattr("details", PyDict::new(py))?;
        Ok(PyErr::from_value(exc))
    };
    build().unwrap_or_else(|_| PyRuntimeError::new_err(message.clone()))
}

fn build(py: Python<'_>, e: &Error, comm: Option<&PyComm>) -> PyResult<PyErr> {
    let (class, kind) = class_and_kind(e);
    let module = py.import("zarrckpt._errors")?;
    let exc = module.getattr(class)?.call1((message(e),))?;
    exc.setattr("kind", kind)?;
    let details = PyDict::new(py);
    match e {
        Error::RemoteFailure { rank, .. }
        | Error::UnexpectedKeys { rank, .. }
        | Error::DtypeMismatch { rank, .. }
        | Error::ShapeMismatch { rank, .. }
        | Error::SaveInFlight { rank, .. }
        | Error::Background { rank, .. } => details.set_item("rank", *rank)?,
        Error::StorageNotShared { ranks, .. } => details.set_item("ranks", ranks.clone())?,
        _ => {}
    }
    match e {
        Error::UnexpectedKeys { keys, path, .. } | Error::MissingKeys { keys, path } => {
            let keys: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
            details.set_item("keys", keys)?;
            details.set_item("path", path.display().to_string())?;
        }
        Error::DtypeMismatch { key, path, .. }
        | Error::ShapeMismatch { key, path, .. }
        | Error::ObjectScopeMismatch { key, path, .. }
        | Error::ObjectRankMissing { key, path, .. }
        | Error::ObjectGridMismatch { key, path, .. } => {
            details.set_item("key", key.as_str())?;
            details.set_item("path", path.display().to_string())?;
        }
        Error::InconsistentPieces { key, .. } => details.set_item("key", key.as_str())?,
        Error::StorageNotShared { path, .. }
        | Error::SaveInFlight { path, .. }
        | Error::Background { path, .. } => details.set_item("path", path.display().to_string())?,
        _ => {}
    }
    exc.setattr("details", details)?;
    let err = PyErr::from_value(exc);
    if let Some(cause) = comm.and_then(PyComm::take_error) {
        err.set_cause(py, Some(cause));
    }
    Ok(err)
}
