"""Fixtures that write checkpoints for the fastsafetensors tests."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fst_testutils as U  # noqa: E402

SOURCE_PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "python"


def _package_dir() -> Path | None:
    spec = importlib.util.find_spec("fastsafetensors_rs")
    return Path(spec.origin).resolve().parent if spec and spec.origin else None


def pytest_report_header(config):
    return f"fastsafetensors_rs from {_package_dir()}, torch {torch.__version__}"


def pytest_configure(config):
    """With FASTSAFETENSORS_TEST_INSTALLED=1 (what `make test` sets) the suite must test the
    installed package: one imported from the source tree (an editable install, python/ on
    sys.path) is refused."""
    if os.environ.get("FASTSAFETENSORS_TEST_INSTALLED") != "1":
        return
    package = _package_dir()
    if package is None:
        raise pytest.UsageError("fastsafetensors_rs is not installed in this environment")
    if package.is_relative_to(SOURCE_PACKAGE_ROOT):
        raise pytest.UsageError(
            f"fastsafetensors_rs would be imported from the source tree ({package}), not from an "
            "installed wheel: run `make build` (or unset FASTSAFETENSORS_TEST_INSTALLED)")


@pytest.fixture(autouse=True)
def _no_reader_env(monkeypatch):
    """Tests start without a reader default from the environment."""
    monkeypatch.delenv(U.ENV_READER, raising=False)


@pytest.fixture
def all_dtypes_file(tmp_path):
    """A single checkpoint holding every dtype, zero-sized and scalar tensors, with metadata.
    Returns (path, tensors written)."""
    tensors = U.all_dtype_tensors(seed=1)
    path = U.write_checkpoint(tmp_path / "all_dtypes.safetensors", tensors,
                              metadata={"format": "pt", "note": "all dtypes"})
    return path, tensors


@pytest.fixture
def multi_file_model(tmp_path):
    """A three-shard model (as a sharded LLM checkpoint is laid out).
    Returns (paths, tensors of each shard)."""
    shards = [
        {
            "model.embed_tokens.weight": U.random_tensor(torch.bfloat16, (64, 32), 1),
            "model.layers.0.self_attn.q_proj.weight": U.random_tensor(torch.bfloat16, (32, 32), 2),
            "model.layers.0.input_layernorm.weight": U.random_tensor(torch.float32, (32,), 3),
        },
        {
            "model.layers.1.self_attn.q_proj.weight": U.random_tensor(torch.float8_e4m3fn, (32, 32), 4),
            "model.layers.1.self_attn.q_proj.weight_scale": U.random_tensor(torch.float32, (), 5),
            "model.layers.1.mlp.gate_proj.bias": U.random_tensor(torch.float16, (48,), 6),
            "model.layers.1.mlp.expert_ids": U.random_tensor(torch.int64, (8,), 7),
        },
        {
            "lm_head.weight": U.random_tensor(torch.bfloat16, (64, 32), 8),
            "model.norm.weight": U.random_tensor(torch.float32, (32,), 9),
            "model.rotary.mask": U.random_tensor(torch.bool, (4, 4), 10),
        },
    ]
    paths = [
        U.write_checkpoint(tmp_path / f"model-{i + 1:05d}-of-00003.safetensors", shard,
                           metadata={"format": "pt", "shard": str(i)})
        for i, shard in enumerate(shards)
    ]
    return paths, shards


@pytest.fixture
def medium_file(tmp_path):
    """An ~8 MiB checkpoint on the test's own directory (ext4 here), large enough for the
    page-cache policy to have many pages to look at. Returns (path, tensors)."""
    tensors = {
        "a.weight": U.finite_tensor(torch.bfloat16, (1024, 1024), 11),
        "b.weight": U.finite_tensor(torch.float32, (512, 1024), 12),
        "b.bias": U.finite_tensor(torch.float32, (1024,), 13),
        "c.ids": U.random_tensor(torch.int64, (1000,), 14),
        "d.scalar": U.finite_tensor(torch.float64, (), 15),
    }
    path = U.write_checkpoint(tmp_path / "medium.safetensors", tensors)
    return path, tensors


@pytest.fixture(scope="session")
def no_o_direct_preload(tmp_path_factory):
    """An LD_PRELOAD library that makes every open() with O_DIRECT fail with EINVAL, as a
    file system without O_DIRECT support does. Lets the buffered fallback be exercised on
    any machine (tmpfs supports O_DIRECT since Linux 6.6)."""
    src = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <sys/types.h>

static int refuse(int flags) {
    if (flags & O_DIRECT) { errno = EINVAL; return 1; }
    return 0;
}

#define OPEN_LIKE(name)                                                      \
int name(const char *path, int flags, ...) {                                 \
    mode_t mode = 0;                                                         \
    if (flags & (O_CREAT | O_TMPFILE)) {                                     \
        va_list ap; va_start(ap, flags); mode = va_arg(ap, mode_t); va_end(ap); \
    }                                                                        \
    if (refuse(flags)) return -1;                                            \
    int (*real)(const char *, int, ...) = dlsym(RTLD_NEXT, #name);           \
    return real(path, flags, mode);                                          \
}

#define OPENAT_LIKE(name)                                                    \
int name(int dirfd, const char *path, int flags, ...) {                      \
    mode_t mode = 0;                                                         \
    if (flags & (O_CREAT | O_TMPFILE)) {                                     \
        va_list ap; va_start(ap, flags); mode = va_arg(ap, mode_t); va_end(ap); \
    }                                                                        \
    if (refuse(flags)) return -1;                                            \
    int (*real)(int, const char *, int, ...) = dlsym(RTLD_NEXT, #name);      \
    return real(dirfd, path, flags, mode);                                   \
}

OPEN_LIKE(open)
OPEN_LIKE(open64)
OPENAT_LIKE(openat)
OPENAT_LIKE(openat64)
"""
    d = tmp_path_factory.mktemp("preload")
    c = d / "no_o_direct.c"
    c.write_text(src)
    so = d / "no_o_direct.so"
    cc = os.environ.get("CC", "cc")
    proc = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(so), str(c), "-ldl"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"building the O_DIRECT shim failed:\n{proc.stderr}"
    return so
