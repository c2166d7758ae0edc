"""Conversion tables (Megatron-Core <-> Hugging Face <-> vLLM): load, validate, expand, plan, run.

A conversion table is JSON data (``spec/format.md`` section 19, schema
``spec/schema/mapping.schema.json``): parameters computed from the Hugging Face ``config.json``,
rules relating each Megatron tensor (keyed as ``dist_checkpointing`` stores it) to its Hugging
Face tensors by one index op, drop lists, checks, and vLLM's per-rank tensors. Everything here
runs in the Rust engine (``zarrckpt::convert``) through the extension, the same code as the
``zarrckpt`` command line; nothing is re-implemented in Python and no process is started:

* :func:`load_table` reads a built-in table by name (``llama``, ``qwen2``, ``qwen3``,
  ``qwen3_moe``, ``deepseek_v3``) or a file, validates it against the JSON schema, and resolves
  ``extends`` (a user file extends or overrides a built-in table);
* :func:`expand` evaluates the parameters and checks for one ``config.json`` and layout
  (``tp``, ``pp``, ``ep``) and expands the name patterns: every Megatron tensor (with its full
  shape, stack axes first) and every Hugging Face tensor (name, shape) the table relates;
* :func:`plan` gives the checked plan from metadata alone, :func:`vllm_rank` fills one vLLM
  rank's buffers straight from a checkpoint;
* :func:`export_hf`, :func:`import_hf`, :func:`export_vllm`, :func:`inspect` run the
  conversions (plan checked from metadata, then streamed by parallel writers, the GIL
  released). A refused conversion raises :class:`ConversionError` (rule, key and numbers).

Errors in a table or in its evaluation raise :class:`TableError`, naming the table, the place in
the document (a JSON pointer) or the rule, and the numbers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import _native
from ._errors import ConversionError, TableError

__all__ = [
    "TableError",
    "ConversionError",
    "builtin_tables",
    "load_table",
    "validate_table",
    "evaluate",
    "expand",
    "Expansion",
    "plan",
    "vllm_rank",
    "export_hf",
    "import_hf",
    "export_vllm",
    "inspect",
]

Table = dict | str | os.PathLike
Config = Mapping[str, Any] | str | os.PathLike


def _table_arg(table: Table) -> str:
    """A table for the engine: a built-in name, a file path, or a loaded table as JSON text."""
    return json.dumps(table) if isinstance(table, dict) else os.fspath(table)


def _config(config: Config) -> dict:
    """A config.json: a dict, or the path of the file or of its folder."""
    if isinstance(config, Mapping):
        return dict(config)
    p = Path(config)
    return json.loads((p / "config.json" if p.is_dir() else p).read_text())


def _layout(tp: int, pp: int, ep: int) -> str:
    return f"tp={tp},pp={pp},ep={ep}"


# ---------------------------------------------------------------------------------------------
# tables


def builtin_tables() -> list[str]:
    """The names of the built-in tables."""
    return sorted(_native.table_builtins())


def load_table(name_or_path: str | os.PathLike) -> dict:
    """The table ``name_or_path`` (a built-in name or a JSON file), validated and with its
    ``extends`` chain resolved: the returned document has no ``extends``/``remove_rules``."""
    return json.loads(_native.table_load(os.fspath(name_or_path)))


def validate_table(doc: Any, source: str = "table") -> None:
    """Validates one table document (before ``extends`` is resolved) against the JSON schema
    and the name-pattern rule of section 19.3; raises :class:`TableError` listing the
    violations with their JSON pointers."""
    _native.table_validate(json.dumps(doc), source)


def evaluate(expr: str | int | bool, env: Mapping[str, Any], config: Mapping[str, Any]) -> Any:
    """The value (int or bool) of one expression; ``env`` holds params, layout parameters and
    captures, ``config`` the HF config.json."""
    text = _native.table_evaluate(json.dumps(expr), json.dumps(dict(env)), json.dumps(dict(config)))
    return json.loads(text)


@dataclass
class Expansion:
    """A table expanded for one config.json and layout."""

    table: str
    params: dict[str, Any]
    megatron: dict[str, tuple[int, ...]]
    hf: dict[str, tuple[int, ...]]
    sources: dict[str, list[str]]
    drop: dict[str, list[str]]
    objects: list[str]
    vllm_version: str

    def megatron_tensors(self) -> dict[str, tuple[int, ...]]:
        """Megatron key -> global shape (as zarrckpt stores it)."""
        return dict(self.megatron)

    def hf_tensors(self) -> dict[str, tuple[int, ...]]:
        """HF name -> shape, in rule order."""
        return dict(self.hf)

    def hf_sources(self) -> dict[str, list[str]]:
        """Megatron key -> the HF tensors it is made of (all stack indices)."""
        return {k: list(v) for k, v in self.sources.items()}


def expand(table: Table, config: Config, *, tp: int = 1, pp: int = 1, ep: int = 1) -> Expansion:
    """Evaluates ``table`` (a loaded table or a name/path) for ``config`` (a dict or the path
    of a config.json or of its folder) at Megatron layout ``tp`` x ``pp`` x ``ep``: params,
    checks, and every rule expanded over its stack. Raises :class:`TableError` for a failed
    expression or check, or a TP/EP split that does not divide (naming rule, key, numbers)."""
    doc = json.loads(
        _native.table_expand(_table_arg(table), json.dumps(_config(config)), _layout(tp, pp, ep))
    )
    return Expansion(
        table=doc["table"],
        params=doc["params"],
        megatron={k: tuple(s) for k, s in doc["megatron"]},
        hf={k: tuple(s) for k, s in doc["hf"]},
        sources=doc["sources"],
        drop=doc["drop"],
        objects=doc["objects"],
        vllm_version=doc["vllm_version"],
    )


# ---------------------------------------------------------------------------------------------
# running conversions


def _export(ckpt, out, map, tp, config, copy_from, max_shard_size, megatron, procs, dry_run):
    """An HF export (``tp`` None) or a vLLM one, in the extension."""
    return _native.export(
        ckpt,
        out,
        _table_arg(map),
        tp=tp,
        config=config,
        copy_from=copy_from,
        max_shard_size=None if max_shard_size is None else str(max_shard_size),
        layout=megatron,
        procs=procs,
        dry_run=dry_run,
    )


def export_hf(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    map: Table,
    *,
    config: str | os.PathLike | None = None,
    copy_from: str | os.PathLike | None = None,
    max_shard_size: str | int | None = None,
    megatron: str | None = None,
    procs: int | None = None,
    dry_run: bool = False,
) -> str:
    """Megatron-layout checkpoint -> Hugging Face safetensors files + index (``procs``
    parallel writers, each writing whole files); returns the summary (the plan with
    ``dry_run``). ``megatron`` (``"tp=T,pp=P"``): the layout the checkpoint was saved at when
    its metadata does not say (it fixes the vocab padding)."""
    return _export(
        ckpt, out, map, None, config, copy_from, max_shard_size, megatron, procs, dry_run
    )


def import_hf(
    hf_dir: str | os.PathLike,
    out: str | os.PathLike,
    map: Table,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    procs: int | None = None,
    overwrite: bool = False,
    dry_run: bool = False,
) -> str:
    """Hugging Face folder -> zarrckpt checkpoint in Megatron's layout for ``tp`` x ``pp`` x
    ``ep`` (loadable with ``zarrckpt.megatron`` / ``dist_checkpointing.load``), ``procs``
    writer threads; returns the summary (the plan with ``dry_run``)."""
    return _native.import_hf(
        hf_dir,
        out,
        _table_arg(map),
        _layout(tp, pp, ep),
        procs=procs,
        overwrite=overwrite,
        dry_run=dry_run,
    )


def export_vllm(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    map: Table,
    *,
    tp: int,
    config: str | os.PathLike | None = None,
    copy_from: str | os.PathLike | None = None,
    max_shard_size: str | int | None = None,
    megatron: str | None = None,
    procs: int | None = None,
    dry_run: bool = False,
) -> str:
    """Megatron-layout checkpoint -> vLLM ``sharded_state`` per-rank files for TP ``tp``
    (``model-rank-{r}-part-{p}.safetensors``, parts of at most ``max_shard_size``; ``procs``
    parallel writers, each writing whole ranks), with ``config.json`` (or every non-weight
    file of ``copy_from``: tokenizer, generation config) so that
    ``vllm.LLM(model=out, load_format="sharded_state")`` opens the folder."""
    return _export(ckpt, out, map, tp, config, copy_from, max_shard_size, megatron, procs, dry_run)


def inspect(
    ckpt: str | os.PathLike,
    map: Table,
    *,
    config: str | os.PathLike | None = None,
    megatron: str | None = None,
) -> str:
    """The HF export plan of a checkpoint under a table (as ``zarrckpt inspect --map``)."""
    return _native.inspect_map(ckpt, _table_arg(map), config=config, layout=megatron)


# ---------------------------------------------------------------------------------------------
# plans from metadata, and one vLLM rank into a caller's buffers


def plan(
    kind: str,
    table: Table,
    source: str | os.PathLike | Mapping[str, Any],
    *,
    config: Config | None = None,
    layout: str | None = None,
    tp: int = 1,
    max_shard_bytes: int = 5_000_000_000,
) -> dict:
    """The conversion plan, computed by the Rust planner from metadata alone (every check of
    spec section 19.5 included; a refusal raises ``zarrckpt.PlanError`` naming rule, key and
    numbers). ``kind``: ``"hf"`` (export), ``"vllm"`` (per-rank tensors for TP ``tp``), or
    ``"megatron"`` (import). ``source``: a Megatron-layout checkpoint (``"hf"``, ``"vllm"``:
    its HF config and saved layout are read from its metadata unless given), or for
    ``"megatron"`` an inventory ``{name: [dtype, shape]}`` of the HF tensors. Returns the plan
    as a dict: ``dests`` (name, dtype, shape, ``group`` = output file or rank, ``pieces`` of
    ``src`` index, source box ``sbox`` and destination box ``dbox`` as ``[offsets, lengths]``,
    ``transpose``), ``sources``, ``bytes_per_group``, ``checks``, ``params``,
    ``vllm_version``."""
    cfg = None if config is None else json.dumps(_config(config))
    if isinstance(source, Mapping):
        if cfg is None:
            raise TableError("no config.json given for an inventory")
        inventory = json.dumps({k: list(v) for k, v in source.items()})
        text = _native.convert_plan(
            kind, _table_arg(table), cfg, inventory, layout or _layout(1, 1, 1), tp, max_shard_bytes
        )
    else:
        p = _native.ConversionPlan(
            kind, _table_arg(table), source, cfg, layout, tp, max_shard_bytes
        )
        text = p.to_json()
    return json.loads(text)


def vllm_rank(
    ckpt: str | os.PathLike,
    map: Table,
    *,
    tp: int,
    rank: int,
    out: dict | None = None,
    config: Config | None = None,
    report: dict | None = None,
) -> dict:
    """vLLM's tensors of one TP rank (``{name: numpy array}``, names as vLLM's
    ``sharded_state`` files carry them), read straight from a Megatron-layout checkpoint by
    the Rust engine: only this rank's boxes are read, each merged box once, into ``out``'s
    buffers when given (C-contiguous numpy arrays of the destination's dtype and shape;
    elements no source covers, the vocabulary padding, are left as they are), else into
    zeroed arrays. ``report`` (a dict) gets ``bytes_read``: the bytes read from storage."""
    import numpy as np

    from .reader import numpy_dtype

    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is not in 0..{tp}")
    cfg = None if config is None else json.dumps(_config(config))
    p = _native.ConversionPlan("vllm", _table_arg(map), ckpt, cfg, None, tp)
    dests = json.loads(p.to_json())["dests"]
    out = {} if out is None else out
    read = 0
    for start, stop in p.batches():
        if dests[start]["group"] != rank:
            continue
        buffers = []
        for d in dests[start:stop]:
            name, dtype = d["name"], numpy_dtype(d["dtype"])
            if name not in out:
                out[name] = np.zeros(d["shape"], dtype=dtype)
            buf = np.asarray(out[name])
            if tuple(buf.shape) != tuple(d["shape"]) or buf.dtype != dtype:
                raise ValueError(
                    f"{name}: buffer {buf.dtype}{list(buf.shape)}, the plan says "
                    f"{d['dtype']}{d['shape']}"
                )
            if not (buf.flags.c_contiguous and buf.flags.writeable):
                raise ValueError(f"{name}: the buffer must be C-contiguous and writable")
            buffers.append((buf.ctypes.data, buf.nbytes))
        read += p.fill(start, stop, buffers)[0]
    if report is not None:
        report["bytes_read"] = report.get("bytes_read", 0) + read
    return out
