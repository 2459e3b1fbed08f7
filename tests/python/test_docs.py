"""The migration guide's snippet runs as the guide says to run it (docs/migration.md), and
the docs name this package's API as `fastsafetensors_rs`, never as IBM's `fastsafetensors`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file as st_load_file

import fst_testutils as U

MIGRATION = Path(__file__).resolve().parents[2] / "docs" / "migration.md"

# What the snippet's results must be, appended to it unchanged.
CHECK = """
import os
from safetensors.torch import load_file
ref = {**load_file("a.safetensors"), **load_file("b.safetensors")}
rank = int(os.environ["RANK"])  # the group is destroyed by now
assert torch.equal(embed, ref["embed_tokens.weight"])
want_qkv = torch.cat([ref[n].chunk(2, dim=0)[rank] for n in ("q.weight", "k.weight", "v.weight")], dim=0)
assert torch.equal(qkv, want_qkv)
assert torch.equal(down, ref["down_proj.weight"].chunk(2, dim=1)[rank])
print(f"rank {rank} of {os.environ['WORLD_SIZE']}: ok", flush=True)
"""


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", MIGRATION.read_text(), re.DOTALL)


def test_the_snippet_runs_under_the_command_the_guide_gives(tmp_path):
    snippet = _blocks("python")[0]
    command = _blocks("sh")[0].split()
    assert command == ["torchrun", "--nproc-per-node", "2", "load.py"]
    torch.manual_seed(0)
    U.write_checkpoint(tmp_path / "a.safetensors", {
        "embed_tokens.weight": torch.randn(16, 8), "q.weight": torch.randn(8, 8),
        "k.weight": torch.randn(4, 8), "v.weight": torch.randn(4, 8)})
    U.write_checkpoint(tmp_path / "b.safetensors", {"down_proj.weight": torch.randn(8, 16)})
    assert set(st_load_file(str(tmp_path / "b.safetensors"))) == {"down_proj.weight"}
    (tmp_path / "load.py").write_text(snippet + CHECK)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    proc = subprocess.run([torchrun, *command[1:]], cwd=tmp_path, capture_output=True, text=True,
                          env=U.subprocess_env({"OMP_NUM_THREADS": "1"}), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(re.findall(r"rank \d of 2: ok", proc.stdout)) == ["rank 0 of 2: ok", "rank 1 of 2: ok"]

    # Without torchrun, as the guide warns, init_process_group finds no rank.
    plain = subprocess.run([sys.executable, "load.py"], cwd=tmp_path, capture_output=True, text=True,
                           env=U.subprocess_env(), timeout=300)
    assert plain.returncode != 0 and "environment variable RANK expected, but not set" in plain.stderr


# ---------------------------------------------------------------- names of this package and IBM's

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# `fastsafetensors.<name>` in the docs means IBM's package (this one is `fastsafetensors_rs`):
# the names of its API that the docs speak of on purpose (what `install_as_fastsafetensors()`
# routes, and what it does not provide).
IBM_NAMES = {"loader", "parallel_loader", "common", "st_types", "file_buffer", "cpp", "AutoLoader",
             "SafeTensorsFileLoader", "SingleGroup", "fastsafe_open", "ParallelLoader", "FilesBufferOnDevice", "DType",
             "saver", "ParallelSaver"}


def _prefixed_names():
    """(file, line number, prefix, name) of every `fastsafetensors.<name>` in the docs."""
    for doc in DOCS:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            for m in re.finditer(r"(?<![\w.])(torch\.ops\.)?fastsafetensors\.([A-Za-z_]\w*)", line):
                yield doc.relative_to(ROOT), number, m[1] or "", m[2]


def test_fastsafetensors_prefixed_names_are_ibms_api_or_the_ops():
    """A `fastsafetensors.` name is IBM's API on purpose, or one of this package's ops
    (`torch.ops.fastsafetensors.<op>`); this package's own functions are `fastsafetensors_rs.*`."""
    import fastsafetensors_rs

    ops = fastsafetensors_rs.ops
    found = list(_prefixed_names())
    assert any(prefix for _, _, prefix, _ in found) and any(not prefix for _, _, prefix, _ in found)
    wrong = [f"{doc}:{n}: {prefix}fastsafetensors.{name}" for doc, n, prefix, name in found
             if (not hasattr(ops, name) if prefix else name not in IBM_NAMES)]
    assert wrong == [], "\n".join(wrong)
