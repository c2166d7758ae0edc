"""The README's Python example, run as written: extracted from README.md and started with
torchrun on 2 CPU processes (gloo), twice in the same directory (the second run replaces the
first run's checkpoints). The README's Rust examples run as doc tests (`cargo test --doc`)."""

from __future__ import annotations

import re
from pathlib import Path

import distributed

import zarrckpt

README = Path(__file__).resolve().parents[2] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", README.read_text(), flags=re.S | re.M)


def test_the_readme_has_its_python_example():
    blocks = python_blocks()
    assert len(blocks) == 1, len(blocks)
    assert "zc.save(state" in blocks[0] and "zarrckpt.open(" in blocks[0]


def test_the_readme_python_example_runs_under_torchrun(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(python_blocks()[0])
    for run in range(2):
        out = distributed.torchrun(script, cwd=tmp_path)
        assert out.returncode == 0, f"run {run}:\n{out.stdout}\n{out.stderr}"
        ck = zarrckpt.open(tmp_path / "ckpt" / "step-1200")
        assert ck.world_size == 2
        assert ck.object("step") == 1200
        assert "model/weight" in ck.tensors
        assert zarrckpt.open(tmp_path / "ckpt" / "step-1300").object("step") == 1200
