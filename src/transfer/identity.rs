//! The conversion plan of a trainer that already holds HF-named tensors (FSDP / FSDP2
//! DTensors of a `transformers` model, or any state dict in checkpoint names) for an engine
//! holding whole HF tensors: every tensor is copied as it is, after the table's checks of an
//! HF input (`import --hf`'s): every tensor the table expects for the config is there with the
//! config-implied shape and data type, and every tensor there is expected or listed in the
//! table's `drop.hf`. Destinations are the tensors `export --hf` writes (fp8 scales aside), in
//! its order.

use crate::convert::geom::Bx;
use crate::convert::{
    ConvertError, Dest, Direction, Inventory, Layout, Piece, Plan, Source, Table,
};
use crate::model::DType;

/// The plan copying HF-named tensors `inv` (name -> (dtype, shape)) whole.
///
/// # Errors
/// The table's expansion and structure errors, and [`ConvertError::Missing`],
/// [`ConvertError::Shape`], [`ConvertError::Dtype`] or [`ConvertError::Unconsumed`] naming the
/// rule, the tensor and the numbers.
pub fn plan_hf_identity(
    table: &Table,
    config: &serde_json::Value,
    inv: &Inventory,
) -> Result<Plan, ConvertError> {
    let layout = Layout {
        tp: 1,
        pp: 1,
        ep: 1,
    };
    let ex = crate::convert::expand(table, config, layout)?;
    crate::convert::check::check_structure(&ex, Direction::Import)?;
    crate::convert::check::check_hf_input(&ex, inv)?;
    let aux: Vec<usize> = ex.aux.iter().map(|a| a.1).collect();
    let mut order: Vec<usize> = (0..ex.h.len()).filter(|h| !aux.contains(h)).collect();
    order.sort_by(|a, b| ex.h[*a].order.cmp(&ex.h[*b].order));
    let mut sources = Vec::with_capacity(order.len());
    let mut dests = Vec::with_capacity(order.len());
    for hi in order {
        let h = &ex.h[hi];
        let (dt, shape) = &inv[&h.name];
        let dtype = DType::from_name(dt).ok_or_else(|| ConvertError::Table {
            table: table.name.clone(),
            msg: format!("tensor `{}`: unknown data type `{dt}`", h.name),
        })?;
        let full = Bx::full(shape);
        dests.push(Dest {
            name: h.name.clone(),
            shape: shape.clone(),
            region: full.clone(),
            dtype,
            pieces: vec![Piece {
                src: sources.len(),
                sbox: full.clone(),
                dbox: full,
                transpose: false,
                rule: h.order.1,
                src_stack: 0,
                dst_stack: 0,
                scale: None,
            }],
            group: 0,
            value: Vec::new(),
        });
        sources.push(Source {
            name: h.name.clone(),
            shape: shape.clone(),
            dtype,
        });
    }
    let checks = vec![
        format!(
            "every HF tensor the table expects for the config present with its shape ({} tensors)",
            dests.len()
        ),
        "every trainer tensor expected or listed in drop.hf".into(),
    ];
    Ok(Plan {
        sources,
        dests,
        checks,
        params: ex.params.clone(),
        expanded: ex,
    })
}
