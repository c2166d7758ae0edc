//! The state-dict front doors: [`save_state`] flattens a nested [`StateDict`] into a
//! [`SaveRequest`] (tensor pieces and objects) and saves it in one checkpoint; [`load_state`] flattens the same
//! structure of load targets and objects, loads, and fills the leaves in place.

use std::path::Path;

use crate::comm::Communicator;
use crate::coord::agree;
use crate::error::{Error, Result};
use crate::load::{LoadOptions, LoadReport, load_with_objects};
use crate::model::state::{StateDict, StateError, StateValue};
use crate::model::{LoadTarget, ObjectRequest, ObjectValue, TensorKey};
use crate::save::{SaveOptions, SaveReport, SaveRequest};

/// Saves a nested state dict: every leaf under its flattened key (`/`-joined path, list
/// positions in decimal; see [`crate::model::state`]). Tensor pieces are saved as by
/// [`crate::save()`], objects and scalars as by [`crate::save_with_objects`]. Every rank calls
/// it with its own state dict of the same structure (the leaves it holds).
///
/// A shorthand for a one-shot save of [`SaveRequest::from_state`] that agrees on the
/// flattening first, so that a rank whose state dict does not flatten fails every rank;
/// repeated and asynchronous saves of a state dict go through a [`crate::Saver`].
///
/// # Errors
/// [`Error::State`] for a state dict that does not flatten (bad map keys, colliding paths,
/// load targets among the leaves), and the errors of [`crate::save_with_objects`].
pub fn save_state(
    state: &StateDict<'_>,
    dir: &Path,
    comm: &dyn Communicator,
    opts: &SaveOptions,
) -> Result<SaveReport> {
    let request = agree(comm, SaveRequest::from_state(state))?;
    crate::save::save_direct(
        &request.tensors,
        request.objects.as_deref(),
        dir,
        comm,
        opts,
        None,
    )
}

/// What a flattened load asks for.
type LoadLeaves<'s, 'a> = (
    Vec<(TensorKey, &'s mut LoadTarget<'a>)>,
    Vec<(ObjectRequest, &'s mut StateValue<'a>)>,
);

fn to_load<'s, 'a>(state: &'s mut StateDict<'a>, rank: u64) -> Result<LoadLeaves<'s, 'a>> {
    let mut targets = Vec::new();
    let mut objects = Vec::new();
    for (key, leaf) in state.flatten_mut()? {
        match leaf {
            StateValue::Target(t) => targets.push((key, t)),
            StateValue::Object(o) => {
                let mut r = ObjectRequest::for_object(o, rank);
                r.key = key;
                objects.push((r, leaf));
            }
            StateValue::Scalar(_) => {
                objects.push((
                    ObjectRequest {
                        key,
                        slot: crate::model::ObjectSlot::Common,
                        grid: None,
                    },
                    leaf,
                ));
            }
            other => {
                return Err(StateError::WrongLeaf {
                    key,
                    found: other.kind(),
                    wanted: "a load target, an object or a scalar",
                }
                .into());
            }
        }
    }
    Ok((targets, objects))
}

/// Loads a nested state dict in place: load targets are filled, objects and scalars get
/// the stored values (a per-rank object this rank's own). The strict mode applies to the
/// flattened keys, tensors and objects alike; leaves of skipped keys are left untouched.
/// Every rank calls it.
///
/// # Errors
/// [`Error::State`] for a state dict that does not flatten, or a scalar leaf whose stored
/// value is bytes; otherwise the errors of [`load_with_objects`].
pub fn load_state(
    state: &mut StateDict<'_>,
    dir: &Path,
    comm: &dyn Communicator,
    opts: &LoadOptions,
) -> Result<LoadReport> {
    let rank = comm.rank() as u64;
    let (mut target_leaves, object_leaves) = agree(comm, to_load(state, rank))?;
    let requests: Vec<ObjectRequest> = object_leaves.iter().map(|(r, _)| r.clone()).collect();
    let report = {
        let targets = target_leaves
            .iter_mut()
            .map(|(key, t)| t.rekeyed(key.clone()).map_err(Error::from))
            .collect::<Result<Vec<_>>>();
        // Agreed before the collectives of the load, so no rank is left waiting.
        let mut targets = agree(comm, targets)?;
        load_with_objects(&mut targets, &requests, dir, comm, opts)?
    };
    for ((r, leaf), value) in object_leaves.into_iter().zip(&report.objects) {
        let Some(value) = value else { continue };
        match leaf {
            StateValue::Object(o) => o.set_value(value.clone()),
            StateValue::Scalar(s) => match value {
                ObjectValue::Json(v) => *s = v.clone(),
                ObjectValue::Bytes(_) => {
                    return Err(StateError::WrongLeaf {
                        key: r.key,
                        found: "a bytes object",
                        wanted: "a JSON scalar",
                    }
                    .into());
                }
            },
            _ => {}
        }
    }
    Ok(report)
}
