"""Conversion tables (Megatron-Core <-> Hugging Face <-> vLLM) in Python: load, validate, expand.

A conversion table is JSON data (``spec/format.md`` section 19, schema
``spec/schema/mapping.schema.json``): parameters computed from the Hugging Face ``config.json``,
rules relating each Megatron tensor (keyed as ``dist_checkpointing`` stores it) to its Hugging
Face tensors by one index op, drop lists, checks, and vLLM's per-rank tensors. This module is
the Python loader of that format, the same as the Rust one (``zarrckpt::convert``):

* :func:`load_table` reads a built-in table by name (``llama``, ``qwen2``, ``qwen3``,
  ``qwen3_moe``, ``deepseek_v3``) or a file, validates it against the JSON schema, and resolves
  ``extends`` (a user file extends or overrides a built-in table);
* :func:`expand` evaluates the parameters and checks for one ``config.json`` and layout
  (``tp``, ``pp``, ``ep``) and expands the name patterns: every Megatron tensor (with its full
  shape, stack axes first) and every Hugging Face tensor (name, shape) the table relates;
* :func:`export_hf`, :func:`import_hf`, :func:`export_vllm`, :func:`inspect` run the
  conversions themselves with the ``zarrckpt`` command-line tool (the Rust engine: plan checked
  from metadata, then streamed by several processes). A refused conversion raises
  :class:`ConversionError` carrying the tool's message (rule, key and numbers).

Errors in a table or in its evaluation raise :class:`TableError`, naming the table, the place in
the document (a JSON pointer) or the rule, and the numbers.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "TableError",
    "ConversionError",
    "tables_dir",
    "schema_path",
    "builtin_tables",
    "load_table",
    "validate_table",
    "parse_expr",
    "evaluate",
    "expand",
    "Expansion",
    "ExpandedRule",
    "binary",
    "plan",
    "fill",
    "vllm_rank",
    "export_hf",
    "import_hf",
    "export_vllm",
    "inspect",
]


class TableError(ValueError):
    """A table that does not parse, does not validate, or whose expressions or checks fail for
    a given config.json and layout."""


class ConversionError(RuntimeError):
    """The conversion tool refused or failed; ``str(e)`` is its message (stderr)."""

    def __init__(self, message: str, returncode: int, args: list[str]) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.command = args


# ---------------------------------------------------------------------------------------------
# where the tables and the schema are


def _repo_root() -> Path | None:
    env = os.environ.get("ZARRCKPT_REPO")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "tables").is_dir() and (parent / "spec" / "schema").is_dir():
            return parent
    return None


def tables_dir() -> Path:
    """The folder of the built-in tables (``$ZARRCKPT_TABLES``, else ``tables/`` of the
    source tree this package is installed from)."""
    env = os.environ.get("ZARRCKPT_TABLES")
    if env:
        return Path(env)
    root = _repo_root()
    if root is None:
        raise TableError("no built-in tables found: set ZARRCKPT_TABLES (or ZARRCKPT_REPO)")
    return root / "tables"


def schema_path() -> Path:
    """``spec/schema/mapping.schema.json`` (``$ZARRCKPT_MAPPING_SCHEMA`` overrides)."""
    env = os.environ.get("ZARRCKPT_MAPPING_SCHEMA")
    if env:
        return Path(env)
    root = _repo_root()
    if root is None:
        raise TableError("no mapping schema found: set ZARRCKPT_MAPPING_SCHEMA (or ZARRCKPT_REPO)")
    return root / "spec" / "schema" / "mapping.schema.json"


def builtin_tables() -> list[str]:
    return sorted(p.stem for p in tables_dir().glob("*.json"))


# ---------------------------------------------------------------------------------------------
# JSON schema (the subset of draft 2020-12 that mapping.schema.json uses)

_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def _schema_errors(value: Any, schema: Any, root: dict, path: str) -> Iterable[str]:
    if schema is True or schema is None:
        return
    if schema is False:
        yield f"{path or '/'}: not allowed"
        return
    if "$ref" in schema:
        ref = schema["$ref"]
        if not ref.startswith("#/"):
            raise TableError(f"mapping schema: unsupported $ref {ref!r}")
        target: Any = root
        for part in ref[2:].split("/"):
            target = target[part]
        yield from _schema_errors(value, target, root, path)
    where = path or "/"
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_TYPES[t](value) for t in types):
            yield f"{where}: {json.dumps(value)[:60]} is not of type {' or '.join(types)}"
            return
    if "const" in schema and value != schema["const"]:
        yield f"{where}: {json.dumps(value)[:60]} is not {json.dumps(schema['const'])}"
    if "enum" in schema and value not in schema["enum"]:
        yield f"{where}: {json.dumps(value)[:60]} is not one of {schema['enum']}"
    if isinstance(value, str):
        if "pattern" in schema and not re.search(schema["pattern"], value):
            yield f"{where}: {value!r} does not match {schema['pattern']!r}"
        if len(value) < schema.get("minLength", 0):
            yield f"{where}: {value!r} is shorter than {schema['minLength']}"
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            yield f"{where}: {value} is less than {schema['minimum']}"
        if "maximum" in schema and value > schema["maximum"]:
            yield f"{where}: {value} is more than {schema['maximum']}"
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            yield f"{where}: {len(value)} items, at least {schema['minItems']} required"
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            yield f"{where}: {len(value)} items, at most {schema['maxItems']} allowed"
        if "items" in schema:
            for i, item in enumerate(value):
                yield from _schema_errors(item, schema["items"], root, f"{path}/{i}")
    if isinstance(value, dict):
        if len(value) < schema.get("minProperties", 0):
            yield f"{where}: at least {schema['minProperties']} properties required"
        if "maxProperties" in schema and len(value) > schema["maxProperties"]:
            yield f"{where}: at most {schema['maxProperties']} properties allowed"
        for name in schema.get("required", []):
            if name not in value:
                yield f"{where}: required property {name!r} is missing"
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for name, item in value.items():
            sub = f"{path}/{name}"
            if name in props:
                yield from _schema_errors(item, props[name], root, sub)
            elif extra is False:
                yield f"{where}: unknown property {name!r}"
            elif isinstance(extra, dict):
                yield from _schema_errors(item, extra, root, sub)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            ok = [not list(_schema_errors(value, s, root, path)) for s in schema[key]]
            if (key == "anyOf" and not any(ok)) or (key == "oneOf" and sum(ok) != 1):
                yield f"{where}: does not match {key}"
    for sub in schema.get("allOf", []):
        yield from _schema_errors(value, sub, root, path)


_SCHEMA_CACHE: dict[Path, dict] = {}


def validate_table(doc: Any, source: str = "table", schema: dict | None = None) -> None:
    """Validates one table document (before ``extends`` is resolved) against the JSON schema
    and the name-pattern rule of section 19.3; raises :class:`TableError` listing the
    violations with their JSON pointers."""
    if schema is None:
        path = schema_path()
        if path not in _SCHEMA_CACHE:
            _SCHEMA_CACHE[path] = json.loads(path.read_text())
        schema = _SCHEMA_CACHE[path]
    errors = list(_schema_errors(doc, schema, schema, ""))
    if not errors:
        errors = list(_pattern_errors(doc))
    if errors:
        shown = "; ".join(errors[:8]) + (f"; ... ({len(errors)} in all)" if len(errors) > 8 else "")
        raise TableError(f"{source}: {shown}")


_SUBST = re.compile(r"\{([^{}]*)\}")


def _check_pattern(pattern: str, where: str) -> Iterable[str]:
    for comp in pattern.split("."):
        subs = list(_SUBST.finditer(comp))
        if subs and (len(subs) != 1 or subs[0].group(0) != comp):
            yield (
                f"{where}: name pattern {pattern!r}: substitution inside the component "
                f"{comp!r} (each {{expr}} must be a whole dot-separated component, e.g. "
                f"'experts.{{expert}}.w1', never 'weight{{expert}}')"
            )


def _pattern_errors(doc: dict) -> Iterable[str]:
    for i, rule in enumerate(doc.get("rules", [])):
        yield from _check_pattern(rule["megatron"], f"/rules/{i}/megatron ({rule['name']})")
        for j, alias in enumerate(rule.get("megatron_aliases", [])):
            yield from _check_pattern(alias, f"/rules/{i}/megatron_aliases/{j}")
        for j, h in enumerate(rule["hf"]):
            yield from _check_pattern(h["name"], f"/rules/{i}/hf/{j}/name ({rule['name']})")
    for i, t in enumerate(doc.get("vllm", {}).get("tensors", [])):
        yield from _check_pattern(t["name"], f"/vllm/tensors/{i}/name")
        for j, p in enumerate(t["parts"]):
            yield from _check_pattern(p["hf"], f"/vllm/tensors/{i}/parts/{j}/hf")


# ---------------------------------------------------------------------------------------------
# loading and extending


def _read_doc(name_or_path: str | os.PathLike) -> tuple[dict, str]:
    p = Path(name_or_path)
    if p.suffix == ".json" or p.exists() or os.sep in str(name_or_path):
        try:
            return json.loads(p.read_text()), str(p)
        except FileNotFoundError as e:
            raise TableError(f"table file {p} does not exist") from e
        except json.JSONDecodeError as e:
            raise TableError(f"table file {p}: not JSON ({e})") from e
    builtin = tables_dir() / f"{name_or_path}.json"
    if not builtin.exists():
        raise TableError(
            f"no built-in table {str(name_or_path)!r} (built-in: {', '.join(builtin_tables())})"
        )
    return json.loads(builtin.read_text()), f"built-in table {name_or_path}"


def _merge_named(base: list[dict], ext: list[dict]) -> list[dict]:
    out = [copy.deepcopy(r) for r in base]
    index = {r["name"]: i for i, r in enumerate(out)}
    for r in ext:
        if r["name"] in index:
            out[index[r["name"]]] = copy.deepcopy(r)
        else:
            index[r["name"]] = len(out)
            out.append(copy.deepcopy(r))
    return out


def _extend(base: dict, ext: dict, source: str) -> dict:
    out = copy.deepcopy(base)
    for k in ("format", "version", "name", "description"):
        if k in ext:
            out[k] = ext[k]
    params = dict(base.get("params", {}))
    params.update(ext.get("params", {}))
    out["params"] = params
    out["checks"] = base.get("checks", []) + ext.get("checks", [])
    rules = _merge_named(base.get("rules", []), ext.get("rules", []))
    removed = set(ext.get("remove_rules", []))
    unknown = removed - {r["name"] for r in rules}
    if unknown:
        raise TableError(f"{source}: remove_rules names no inherited rule: {sorted(unknown)}")
    out["rules"] = [r for r in rules if r["name"] not in removed]
    drop = {}
    for side in ("megatron", "hf"):
        drop[side] = base.get("drop", {}).get(side, []) + ext.get("drop", {}).get(side, [])
    out["drop"] = drop
    if "vllm" in ext or "vllm" in base:
        bv, ev = base.get("vllm", {}), ext.get("vllm", {})
        tensors = _merge_named(bv.get("tensors", []), ev.get("tensors", []))
        gone = set(ext.get("remove_vllm", []))
        out["vllm"] = {
            "version": ev.get("version", bv.get("version", "")),
            "tensors": [t for t in tensors if t["name"] not in gone],
        }
    if "objects" in ext or "objects" in base:
        out["objects"] = _merge_named(base.get("objects", []), ext.get("objects", []))
    out.pop("extends", None)
    out.pop("remove_rules", None)
    out.pop("remove_vllm", None)
    return out


def load_table(name_or_path: str | os.PathLike, *, validate: bool = True, _seen=()) -> dict:
    """The table ``name_or_path`` (a built-in name or a JSON file), validated and with its
    ``extends`` chain resolved: the returned document has no ``extends``/``remove_rules``."""
    doc, source = _read_doc(name_or_path)
    if validate:
        validate_table(doc, source)
    base_name = doc.get("extends")
    if base_name is None:
        doc.setdefault("params", {})
        doc.setdefault("rules", [])
        return doc
    if (
        base_name in _seen
        or base_name == doc.get("name")
        and not str(name_or_path).endswith(".json")
    ):
        raise TableError(f"{source}: `extends` cycle through {base_name!r}")
    base = load_table(base_name, validate=validate, _seen=(*_seen, base_name))
    return _extend(base, doc, source)


# ---------------------------------------------------------------------------------------------
# expressions (section 19.3)

_TOKEN = re.compile(
    r"\s*(?:(?P<int>\d+)|(?P<name>[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)?)"
    r"|(?P<op>\?\?|\|\||&&|==|!=|<=|>=|//|[-+*/%<>!(),]))"
)


class _Missing(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def _tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise TableError(f"expression {text!r}: cannot read {text[pos : pos + 10]!r}")
        kind = m.lastgroup
        out.append((kind, m.group(kind)))
        pos = m.end()
    return out


class _Parser:
    _LEVELS = [
        ("??",),
        ("||",),
        ("&&",),
        ("==", "!=", "<", "<=", ">", ">="),
        ("+", "-"),
        ("*", "/", "//", "%"),
    ]

    def __init__(self, text: str) -> None:
        self.text = text
        self.toks = _tokens(text)
        self.i = 0

    def peek(self) -> tuple[str, str] | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, value: str | None = None) -> tuple[str, str]:
        t = self.peek()
        if t is None or (value is not None and t[1] != value):
            want = value or "a value"
            got = "the end" if t is None else repr(t[1])
            raise TableError(f"expression {self.text!r}: expected {want}, found {got}")
        self.i += 1
        return t

    def parse(self) -> tuple:
        e = self.binary(0)
        if self.peek() is not None:
            raise TableError(f"expression {self.text!r}: unexpected {self.peek()[1]!r}")
        return e

    def binary(self, level: int) -> tuple:
        if level == len(self._LEVELS):
            return self.unary()
        left = self.binary(level + 1)
        while (t := self.peek()) is not None and t[0] == "op" and t[1] in self._LEVELS[level]:
            self.i += 1
            # `??` is right-associative, the others left
            right = self.binary(level) if t[1] == "??" else self.binary(level + 1)
            left = ("bin", t[1], left, right)
        return left

    def unary(self) -> tuple:
        t = self.peek()
        if t is not None and t[0] == "op" and t[1] in ("!", "-"):
            self.i += 1
            return ("un", t[1], self.unary())
        return self.atom()

    def atom(self) -> tuple:
        kind, value = self.take()
        if kind == "int":
            return ("lit", int(value))
        if kind == "op" and value == "(":
            e = self.binary(0)
            self.take(")")
            return e
        if kind == "name":
            if value in ("true", "false"):
                return ("lit", value == "true")
            if self.peek() == ("op", "("):
                self.i += 1
                args = [self.binary(0)]
                while self.peek() == ("op", ","):
                    self.i += 1
                    args.append(self.binary(0))
                self.take(")")
                if value not in _FUNCS:
                    raise TableError(f"expression {self.text!r}: unknown function {value!r}")
                if len(args) != 2:
                    raise TableError(f"expression {self.text!r}: {value} takes 2 arguments")
                return ("call", value, args)
            if value.startswith("config."):
                return ("config", value[len("config.") :])
            if "." in value:
                raise TableError(f"expression {self.text!r}: unknown name {value!r}")
            return ("name", value)
        raise TableError(f"expression {self.text!r}: unexpected {value!r}")


def _ceil_div(a: int, b: int) -> int:
    if b == 0:
        raise ZeroDivisionError
    return -(-a // b)


def _round_up(a: int, m: int) -> int:
    return _ceil_div(a, m) * m


_FUNCS = {"min": min, "max": max, "round_up": _round_up, "ceil_div": _ceil_div}
_PARSED: dict[str, tuple] = {}
_I64 = (-(2**63), 2**63 - 1)


def parse_expr(expr: str | int | bool) -> tuple:
    """The syntax tree of an expression (cached)."""
    if isinstance(expr, bool | int):
        return ("lit", expr)
    if expr not in _PARSED:
        _PARSED[expr] = _Parser(expr).parse()
    return _PARSED[expr]


def _int(v: Any, what: str, text: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TableError(f"expression {text!r}: {what} is {v!r}, not an integer")
    return v


def _eval(node: tuple, env: Mapping[str, Any], config: Mapping[str, Any], text: str) -> Any:
    kind = node[0]
    if kind == "lit":
        return node[1]
    if kind == "name":
        if node[1] not in env:
            raise TableError(f"expression {text!r}: unknown name {node[1]!r}")
        return env[node[1]]
    if kind == "config":
        if config.get(node[1]) is None:
            raise _Missing(node[1])
        v = config[node[1]]
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        elif isinstance(v, dict):
            v = True  # an object: present
        elif isinstance(v, list):
            v = len(v)
        if not isinstance(v, int | bool):
            raise TableError(f"expression {text!r}: config.{node[1]} is {v!r}, not an integer")
        return v
    if kind == "un":
        v = _eval(node[2], env, config, text)
        if node[1] == "!":
            if not isinstance(v, bool):
                raise TableError(f"expression {text!r}: ! of the non-boolean {v!r}")
            return not v
        return -_int(v, "the operand of -", text)
    if kind == "call":
        args = [
            _int(_eval(a, env, config, text), f"an argument of {node[1]}", text) for a in node[2]
        ]
        try:
            return _FUNCS[node[1]](*args)
        except ZeroDivisionError:
            raise TableError(f"expression {text!r}: {node[1]}({args[0]}, 0)") from None
    op, left, right = node[1], node[2], node[3]
    if op == "??":
        try:
            return _eval(left, env, config, text)
        except _Missing:
            return _eval(right, env, config, text)
    a = _eval(left, env, config, text)
    if op in ("&&", "||"):
        if not isinstance(a, bool):
            raise TableError(f"expression {text!r}: {op} of the non-boolean {a!r}")
        if (op == "&&" and not a) or (op == "||" and a):
            return a
        b = _eval(right, env, config, text)
        if not isinstance(b, bool):
            raise TableError(f"expression {text!r}: {op} of the non-boolean {b!r}")
        return b
    b = _eval(right, env, config, text)
    if op in ("==", "!="):
        return (a == b and type(a) is type(b)) == (op == "==")
    a, b = _int(a, f"the left operand of {op}", text), _int(b, f"the right operand of {op}", text)
    if op == "<":
        return a < b
    if op == "<=":
        return a <= b
    if op == ">":
        return a > b
    if op == ">=":
        return a >= b
    if op in ("/", "//", "%") and b == 0:
        raise TableError(f"expression {text!r}: {a} {op} 0")
    if op == "/":
        if a % b:
            raise TableError(f"expression {text!r}: {a} / {b} does not divide exactly")
        r = a // b
    elif op == "//":
        r = a // b
    elif op == "%":
        r = a % b
    elif op == "+":
        r = a + b
    elif op == "-":
        r = a - b
    else:
        r = a * b
    if not _I64[0] <= r <= _I64[1]:
        raise TableError(f"expression {text!r}: {a} {op} {b} overflows 64 bits")
    return r


def evaluate(expr: str | int | bool, env: Mapping[str, Any], config: Mapping[str, Any]) -> Any:
    """The value (int or bool) of one expression; ``env`` holds params, layout parameters and
    captures, ``config`` the HF config.json."""
    text = str(expr)
    try:
        return _eval(parse_expr(expr), env, config, text)
    except _Missing as m:
        raise TableError(f"expression {text!r}: config.json has no {m.name!r}") from None


# ---------------------------------------------------------------------------------------------
# expansion


@dataclass
class ExpandedRule:
    """One rule at one stack index: Megatron key ``megatron`` (full shape ``megatron_shape``,
    stack axes first), the body's place ``index`` in the stack, and its HF tensors."""

    rule: str
    op: str
    megatron: str
    megatron_shape: tuple[int, ...]
    index: tuple[int, ...]
    hf: list[tuple[str, tuple[int, ...]]]
    body_shape: tuple[int, ...]
    tp: dict | None = None
    ep_capture: str | None = None
    captures: dict[str, int] = field(default_factory=dict)
    place: tuple[int, int, int] | None = None  # (axis, at, size) within the body


@dataclass
class Expansion:
    table: str
    params: dict[str, Any]
    rules: list[ExpandedRule]
    drop: dict[str, list[str]]
    objects: list[str]
    vllm: list[dict]
    vllm_version: str

    def megatron_tensors(self) -> dict[str, tuple[int, ...]]:
        """Megatron key -> global shape (as zarrckpt stores it)."""
        return {r.megatron: r.megatron_shape for r in self.rules}

    def hf_tensors(self) -> dict[str, tuple[int, ...]]:
        """HF name -> shape, in rule order."""
        out: dict[str, tuple[int, ...]] = {}
        for r in self.rules:
            for name, shape in r.hf:
                out.setdefault(name, shape)
        return out

    def hf_sources(self) -> dict[str, list[str]]:
        """Megatron key -> the HF tensors it is made of (all stack indices)."""
        out: dict[str, list[str]] = {}
        for r in self.rules:
            out.setdefault(r.megatron, []).extend(n for n, _ in r.hf)
        return out


def _subst(pattern: str, env: Mapping[str, Any], config: Mapping[str, Any]) -> str:
    return _SUBST.sub(lambda m: str(evaluate(m.group(1), env, config)), pattern)


def _stack_indices(stack: list[dict], env: dict, config: Mapping[str, Any]):
    sizes, ranges = [], []
    for s in stack:
        size = evaluate(s["size"], env, config)
        start = evaluate(s.get("start", 0), env, config)
        stop = evaluate(s.get("stop", size), env, config)
        if not 0 <= start <= stop <= size:
            raise TableError(f"stack {s['capture']}: range [{start}, {stop}) not within 0..{size}")
        sizes.append(size)
        ranges.append(range(start, stop))
    import itertools

    return sizes, itertools.product(*ranges)


def _body_shape(rule: dict, hf: list[tuple[str, tuple[int, ...]]], env, config) -> tuple[int, ...]:
    op = rule["op"]
    first = list(hf[0][1])
    axis = rule.get("axis", 0)
    where = f"rule {rule['name']}"
    if op == "rename":
        return tuple(first)
    if op == "transpose":
        return tuple(reversed(first))
    if op == "pad":
        to = evaluate(rule["to"], env, config)
        if to < first[0]:
            raise TableError(
                f"{where}: pad to {to} rows, fewer than the {first[0]} rows of {hf[0][0]}"
            )
        return (to, *first[1:])
    if op == "slice":
        start, stop = evaluate(rule["start"], env, config), evaluate(rule["stop"], env, config)
        if not 0 <= start <= stop <= first[axis]:
            raise TableError(
                f"{where}: slice [{start}, {stop}) of {hf[0][0]} ({first[axis]} along axis {axis})"
            )
        first[axis] = stop - start
        return tuple(first)
    if op in ("concat", "interleave"):
        for name, shape in hf[1:]:
            if len(shape) != len(first) or any(
                a != b for d, (a, b) in enumerate(zip(shape, first, strict=True)) if d != axis
            ):
                raise TableError(
                    f"{where}: {name} {list(shape)} does not {op} with {hf[0][0]} {first}"
                )
        if op == "interleave":
            groups = evaluate(rule["groups"], env, config)
            for name, shape in hf:
                if groups <= 0 or shape[axis] % groups:
                    raise TableError(
                        f"{where}: {name} has {shape[axis]} rows along axis {axis}, not a "
                        f"multiple of groups = {groups}"
                    )
        first[axis] = sum(shape[axis] for _, shape in hf)
        return tuple(first)
    raise TableError(f"{where}: unknown op {op!r}")


def expand(
    table: dict | str,
    config: Mapping[str, Any] | str | os.PathLike,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
) -> Expansion:
    """Evaluates ``table`` (a loaded table or a name/path) for ``config`` (a dict or the path
    of a config.json or of its folder) at Megatron layout ``tp`` x ``pp`` x ``ep``: params,
    checks, and every rule expanded over its stack. Raises :class:`TableError` for a failed
    expression or check, or a TP/EP split that does not divide (naming rule, key, numbers)."""
    if not isinstance(table, dict):
        table = load_table(table)
    if not isinstance(config, Mapping):
        p = Path(config)
        config = json.loads((p / "config.json" if p.is_dir() else p).read_text())
    name = table.get("name", "table")
    env: dict[str, Any] = {"tp": tp, "pp": pp, "ep": ep}
    for pname, expr in table.get("params", {}).items():
        try:
            env[pname] = evaluate(expr, env, config)
        except TableError as e:
            raise TableError(f"table {name}: param {pname}: {e}") from None
    for check in table.get("checks", []):
        if evaluate(check["expr"], env, config) is not True:
            raise TableError(f"table {name}: check failed: {check['name']} ({check['expr']})")
    rules: list[ExpandedRule] = []
    for rule in table.get("rules", []):
        if "when" in rule and not evaluate(rule["when"], env, config):
            continue
        stack = rule.get("stack", [])
        sizes, indices = _stack_indices(stack, env, config)
        for index in indices:
            cenv = dict(env)
            cenv.update({s["capture"]: i for s, i in zip(stack, index, strict=True)})
            try:
                hf = [
                    (
                        _subst(h["name"], cenv, config),
                        tuple(evaluate(d, cenv, config) for d in h["shape"]),
                    )
                    for h in rule["hf"]
                ]
                body = _body_shape(rule, hf, cenv, config)
                place = None
                if "place" in rule:
                    pl = rule["place"]
                    size = evaluate(pl["size"], cenv, config)
                    if body[pl["axis"]] != size:
                        raise TableError(
                            f"place size {size} differs from the op's {body[pl['axis']]} "
                            f"along axis {pl['axis']}"
                        )
                    place = (pl["axis"], evaluate(pl["at"], cenv, config), size)
                key = _subst(rule["megatron"], cenv, config)
            except TableError as e:
                raise TableError(f"table {name}: rule {rule['name']}: {e}") from None
            tp_spec = None
            if "tp" in rule:
                t = rule["tp"]
                parts = evaluate(t.get("parts", 1), cenv, config)
                axis = t["axis"]
                if axis >= len(body):
                    raise TableError(
                        f"table {name}: rule {rule['name']}: tp axis {axis} of a {len(body)}-d body"
                    )
                seg = body[axis] // parts if parts else 0
                units = evaluate(t["units"], cenv, config) if "units" in t else seg
                if parts <= 0 or body[axis] % parts or units <= 0 or seg % units or units % tp:
                    raise TableError(
                        f"table {name}: rule {rule['name']}: key {key}: "
                        f"cannot split over tp = {tp}: "
                        f"axis {axis} has {body[axis]} = {parts} part(s) of {units} unit(s), and "
                        f"{units} % {tp} = {units % tp}"
                    )
                tp_spec = {"axis": axis, "parts": parts, "units": units}
            for vop in rule.get("value", []):
                dq = vop.get("dequant_fp8_block")
                if dq is not None and evaluate(dq.get("when", True), cenv, config):
                    b0, b1 = dq["block"]
                    hf = hf + [
                        (n + dq["scale"], (_ceil_div(sh[0], b0), _ceil_div(sh[1], b1)))
                        for n, sh in hf
                    ]
            ep_capture = rule.get("ep", {}).get("capture")
            if ep_capture is not None:
                pos = [s["capture"] for s in stack].index(ep_capture)
                if sizes[pos] % ep:
                    raise TableError(
                        f"table {name}: rule {rule['name']}: key {key}: "
                        f"{sizes[pos]} experts do not "
                        f"split over ep = {ep} ({sizes[pos]} % {ep} = {sizes[pos] % ep})"
                    )
            rules.append(
                ExpandedRule(
                    rule=rule["name"],
                    op=rule["op"],
                    megatron=key,
                    megatron_shape=(
                        *(n for s, n in zip(stack, sizes, strict=True) if not s.get("in_name")),
                        *body,
                    ),
                    index=tuple(index),
                    hf=hf,
                    body_shape=body,
                    tp=tp_spec,
                    ep_capture=ep_capture,
                    captures={s["capture"]: i for s, i in zip(stack, index, strict=True)},
                    place=place,
                )
            )
    # a key filled by several placing rules: its body extends over all their places
    whole: dict[tuple[str, tuple[int, ...]], dict[int, int]] = {}
    for er in rules:
        if er.place is not None:
            axis, at, size = er.place
            ends = whole.setdefault((er.megatron, er.index), {})
            ends[axis] = max(ends.get(axis, 0), at + size)
    for er in rules:
        if er.place is not None:
            body = list(er.body_shape)
            body[er.place[0]] = whole[(er.megatron, er.index)][er.place[0]]
            er.body_shape = tuple(body)
            er.megatron_shape = er.megatron_shape[: len(er.megatron_shape) - len(body)] + tuple(
                body
            )
    objects = []
    for obj in table.get("objects", []):
        if "when" in obj and not evaluate(obj["when"], env, config):
            continue
        stack = obj.get("stack", [])
        sizes, indices = _stack_indices(stack, env, config)
        for index in indices:
            cenv = dict(env)
            cenv.update({s["capture"]: i for s, i in zip(stack, index, strict=True)})
            grid = [
                (i, n) for s, i, n in zip(stack, index, sizes, strict=True) if not s.get("in_name")
            ]
            key = _subst(obj["name"], cenv, config)
            if grid:
                off = ".".join(str(i) for i, _ in grid)
                shp = ".".join(str(n) for _, n in grid)
                objects.append(f"{key}/shard_{off}_{shp}")
            else:
                objects.append(f"{key}/shard_0_1")
    vllm = []
    for t in table.get("vllm", {}).get("tensors", []):
        if "when" in t and not evaluate(t["when"], env, config):
            continue
        stack = t.get("stack", [])
        _, indices = _stack_indices(stack, env, config)
        for index in indices:
            cenv = dict(env)
            cenv.update({s["capture"]: i for s, i in zip(stack, index, strict=True)})
            inner = t.get("inner")
            inner_range = [None]
            if inner is not None:
                inner_range = list(range(evaluate(inner["size"], cenv, config)))
            stacked = []
            for j in inner_range:
                ienv = dict(cenv)
                if inner is not None:
                    ienv[inner["capture"]] = j
                parts = []
                for p in t["parts"]:
                    part = {"hf": _subst(p["hf"], ienv, config)}
                    for k in ("axis", "replicate"):
                        if k in p:
                            part[k] = p[k]
                    for k in ("units", "pad_to"):
                        if k in p:
                            part[k] = evaluate(p[k], ienv, config)
                    parts.append(part)
                stacked.append(parts)
            entry = {"name": _subst(t["name"], cenv, config), "axis": t.get("axis", 0)}
            if inner is None:
                entry["parts"] = stacked[0]
            else:
                entry["inner"] = stacked  # one list of parts per index of the new leading axis
            vllm.append(entry)
    return Expansion(
        table=name,
        params=dict(env),
        rules=rules,
        drop={k: list(v) for k, v in table.get("drop", {}).items()},
        objects=objects,
        vllm=vllm,
        vllm_version=table.get("vllm", {}).get("version", ""),
    )


# ---------------------------------------------------------------------------------------------
# running conversions (the Rust engine, through the command-line tool)


def binary() -> str:
    """The ``zarrckpt`` tool: ``$ZARRCKPT_BIN``, else ``target/release/zarrckpt`` of the source
    tree, else ``zarrckpt`` on PATH."""
    env = os.environ.get("ZARRCKPT_BIN")
    if env:
        return env
    root = _repo_root()
    if root is not None:
        for profile in ("release", "debug"):
            cand = root / "target" / profile / "zarrckpt"
            if cand.exists():
                return str(cand)
    found = shutil.which("zarrckpt")
    if found is None:
        raise ConversionError(
            "the zarrckpt command-line tool was not found (set ZARRCKPT_BIN)", 127, []
        )
    return found


def _run(args: list[str]) -> str:
    cmd = [binary(), *[str(a) for a in args]]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        msg = proc.stderr.strip() or proc.stdout.strip() or f"exit status {proc.returncode}"
        raise ConversionError(msg, proc.returncode, cmd)
    return proc.stdout


def _common(map: str | os.PathLike, procs: int | None, dry_run: bool) -> list[str]:
    out = ["--map", str(map)]
    if procs is not None:
        out += ["--procs", str(procs)]
    if dry_run:
        out.append("--dry-run")
    return out


def export_hf(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    map: str | os.PathLike,
    *,
    config: str | os.PathLike | None = None,
    copy_from: str | os.PathLike | None = None,
    max_shard_size: str | int | None = None,
    megatron: str | None = None,
    procs: int | None = None,
    dry_run: bool = False,
) -> str:
    """Megatron-layout checkpoint -> Hugging Face safetensors files + index; returns the
    tool's output (the plan with ``dry_run``). ``megatron`` (``"tp=T,pp=P"``): the layout the
    checkpoint was saved at when its metadata does not say (it fixes the vocab padding)."""
    args = ["export", "--hf", *_common(map, procs, dry_run), str(ckpt), "--out", str(out)]
    if megatron is not None:
        args += ["--megatron", megatron]
    if config is not None:
        args += ["--config", str(config)]
    if copy_from is not None:
        args += ["--copy-from", str(copy_from)]
    if max_shard_size is not None:
        args += ["--max-shard-size", str(max_shard_size)]
    return _run(args)


def import_hf(
    hf_dir: str | os.PathLike,
    out: str | os.PathLike,
    map: str | os.PathLike,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    procs: int | None = None,
    dry_run: bool = False,
) -> str:
    """Hugging Face folder -> zarrckpt checkpoint in Megatron's layout for ``tp`` x ``pp`` x
    ``ep`` (loadable with ``zarrckpt.megatron`` / ``dist_checkpointing.load``)."""
    layout = f"tp={tp},pp={pp}" + (f",ep={ep}" if ep != 1 else "")
    args = ["import", "--hf", str(hf_dir), *_common(map, procs, dry_run), "--megatron", layout]
    return _run([*args, "--out", str(out)])


def export_vllm(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    map: str | os.PathLike,
    *,
    tp: int,
    config: str | os.PathLike | None = None,
    megatron: str | None = None,
    procs: int | None = None,
    dry_run: bool = False,
) -> str:
    """Megatron-layout checkpoint -> vLLM ``sharded_state`` per-rank files for TP ``tp``."""
    args = ["export", "--vllm", "--tp", str(tp), *_common(map, procs, dry_run), str(ckpt)]
    if megatron is not None:
        args += ["--megatron", megatron]
    if config is not None:
        args += ["--config", str(config)]
    return _run([*args, "--out", str(out)])


def inspect(
    ckpt: str | os.PathLike, map: str | os.PathLike, *, config: str | os.PathLike | None = None
) -> str:
    """The plan of a checkpoint under a table (``zarrckpt inspect --map``)."""
    args = ["inspect", "--map", str(map), str(ckpt)]
    if config is not None:
        args += ["--config", str(config)]
    return _run(args)


# ---------------------------------------------------------------------------------------------
# the same plan in Python: filling a caller's buffers (an inference engine's own loader)


def _ckpt(path: str | os.PathLike):
    """A Megatron-layout checkpoint directory (or its zarrckpt/ folder), opened."""
    from . import reader

    p = Path(path)
    if (p / "zarrckpt" / "zarr.json").exists():
        p = p / "zarrckpt"
    return reader.open(p)


def plan(
    kind: str,
    table: dict | str | os.PathLike,
    source: str | os.PathLike | Mapping[str, Any],
    *,
    config: Mapping[str, Any] | str | os.PathLike | None = None,
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
    from . import _native

    if isinstance(table, dict):
        table_arg = json.dumps(table)
    else:
        table_arg = str(table)
    if isinstance(source, Mapping):
        inventory = {k: list(v) for k, v in source.items()}
        meta: dict = {}
    else:
        ck = _ckpt(source)
        inventory = {k: [ck.tensors[k].dtype, list(ck.tensors[k].shape)] for k in ck}
        meta = ck.metadata
    if config is None:
        config = meta.get("hf_config")
        if config is None:
            raise TableError("no config.json given and none stored in the checkpoint's metadata")
    elif not isinstance(config, Mapping):
        p = Path(config)
        config = json.loads((p / "config.json" if p.is_dir() else p).read_text())
    if layout is None:
        saved = meta.get("megatron", {})
        layout = f"tp={saved.get('tp', 1)},pp={saved.get('pp', 1)},ep={saved.get('ep', 1)}"
    text = _native.convert_plan(
        kind, table_arg, json.dumps(config), json.dumps(inventory), layout, tp, max_shard_bytes
    )
    return json.loads(text)


def fill(
    the_plan: dict,
    group: int,
    read: Any,
    out: dict | None = None,
) -> dict:
    """Fills the destinations of one ``group`` (a vLLM rank, an HF file) of ``the_plan``:
    ``read(source_name, offsets, lengths)`` returns that box of a source as a numpy array;
    ``out`` may hold the caller's preallocated buffers (numpy arrays, or anything numpy can
    write into through ``np.asarray``) by destination name, else zeroed arrays are allocated.
    Returns ``{name: array}``. Elements no piece covers (vocabulary padding) stay as they were
    (zero in allocated arrays). Only index ops run here: a table with value ops (add, fp8
    dequantisation) or casts is executed by the CLI."""
    import numpy as np

    from .reader import numpy_dtype

    out = {} if out is None else out
    sources = the_plan["sources"]
    for d in the_plan["dests"]:
        if d["group"] != group:
            continue
        name = d["name"]
        if name not in out:
            out[name] = np.zeros(d["shape"], dtype=numpy_dtype(d["dtype"]))
        buf = np.asarray(out[name])
        if tuple(buf.shape) != tuple(d["shape"]):
            raise ValueError(f"{name}: buffer of shape {buf.shape}, the plan says {d['shape']}")
        for piece in d["pieces"]:
            src = sources[piece["src"]]
            (soff, slen), (doff, dlen) = piece["sbox"], piece["dbox"]
            data = np.asarray(read(src["name"], soff, slen))
            if piece.get("transpose"):
                data = data.T
            if str(data.dtype) != str(buf.dtype):
                raise ValueError(
                    f"{name}: source {src['name']} is {data.dtype}, the destination "
                    f"{buf.dtype}: casts run in the CLI"
                )
            box = tuple(slice(o, o + n) for o, n in zip(doff, dlen, strict=True))
            buf[box] = data.reshape(dlen)
    return out


def vllm_rank(
    ckpt: str | os.PathLike,
    map: dict | str | os.PathLike,
    *,
    tp: int,
    rank: int,
    out: dict | None = None,
    config: Mapping[str, Any] | str | os.PathLike | None = None,
    report: dict | None = None,
) -> dict:
    """vLLM's tensors of one TP rank (``{name: numpy array}``, names as vLLM's
    ``sharded_state`` files carry them), read straight from a Megatron-layout checkpoint: only
    this rank's boxes are read, into ``out``'s buffers when given. ``report`` (a dict) gets
    ``bytes_read``: the bytes read from storage."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is not in 0..{tp}")
    the_plan = plan("vllm", map, ckpt, config=config, tp=tp)
    ck = _ckpt(ckpt)

    if report is not None:
        report.setdefault("bytes_read", 0)

    def read(name: str, off: list[int], length: list[int]):
        data, r = ck[name].read_box(list(off), list(length))
        if report is not None:
            report["bytes_read"] += int(r.get("bytes_read", 0))
        return data

    return fill(the_plan, rank, read, out)
