"""The build record beside the extension, and which torch may load it (`_build_info`).

tests/install installs the stable-ABI wheel under real torch 2.10, 2.11, 2.14 and 2.15 and
builds the per-torch library against torch 2.8; these tests cover the rule itself and the
import path with a record edited in a copy."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import fastsafetensors_rs
import fst_testutils as U
from fastsafetensors_rs import _build_info

RUNNING = _build_info.describe(torch)


def test_the_installed_extension_records_the_running_torch():
    recorded = json.loads((Path(fastsafetensors_rs.__file__).parent / _build_info.FILE).read_text())
    assert recorded["torch"] == torch.__version__
    if recorded["abi"] == _build_info.STABLE:  # the default build with torch >= 2.11
        assert recorded["min_torch"] == "2.11"
    else:
        assert recorded["abi"] == _build_info.PER_TORCH
        assert recorded["cxx11_abi"] == torch._C._GLIBCXX_USE_CXX11_ABI
    assert _build_info.incompatibility(recorded, RUNNING) is None


STABLE_RECORD = {"abi": "stable", "torch": "2.15.0", "min_torch": "2.11"}


@pytest.mark.parametrize("running", ["2.11.0", "2.11.0+cu130", "2.14.1", "2.15.0", "2.16.0", "3.0.0"])
def test_the_stable_library_loads_under_its_minimum_and_later(running):
    assert _build_info.incompatibility(STABLE_RECORD, {"torch": running, "cxx11_abi": False}) is None


@pytest.mark.parametrize("running", ["2.10.0", "2.10.1+cu128", "2.8.0", "1.13.1"])
def test_the_stable_library_names_the_minimum_and_the_source_build_under_an_older_torch(running):
    problem = _build_info.incompatibility(STABLE_RECORD, {"torch": running, "cxx11_abi": True})
    assert "needs torch>=2.11" in problem and f"this environment has torch {running}" in problem
    assert "pip install --no-build-isolation" in problem and "from source" in problem


def test_records_without_a_kind_are_per_torch():
    """Records written before the stable-ABI library existed."""
    assert _build_info.incompatibility({"torch": "2.14.0", "cxx11_abi": True},
                                       {"torch": "2.15.0", "cxx11_abi": True}) is not None


@pytest.mark.parametrize("built, running", [
    ("2.14.0", "2.14.1"), ("2.14.1+cu128", "2.14.0"), ("2.8.0+cpu", "2.8.0+cu128"), ("2.15.0", "2.15.0"),
])
def test_patch_releases_and_local_labels_are_interchangeable(built, running):
    assert _build_info.incompatibility({"torch": built, "cxx11_abi": True},
                                       {"torch": running, "cxx11_abi": True}) is None


@pytest.mark.parametrize("built, running", [("2.14.0", "2.15.0"), ("2.15.0", "2.8.0"), ("2.8.0", "3.8.0")])
def test_another_minor_release_is_refused_with_both_versions(built, running):
    problem = _build_info.incompatibility({"torch": built, "cxx11_abi": True}, {"torch": running, "cxx11_abi": True})
    assert f"compiled against torch {built}" in problem
    assert f"this environment has torch {running}" in problem
    assert "--no-build-isolation --no-deps --force-reinstall" in problem


def test_another_cxx11_abi_is_refused():
    problem = _build_info.incompatibility({"torch": "2.14.0", "cxx11_abi": False}, {"torch": "2.14.0", "cxx11_abi": True})
    assert "_GLIBCXX_USE_CXX11_ABI=0" in problem and "_GLIBCXX_USE_CXX11_ABI=1" in problem


@pytest.mark.parametrize("record", [
    {"torch": "2.7.1+cu126", "cxx11_abi": True}, {"abi": "stable", "torch": "2.15.0", "min_torch": "2.99"}, None,
], ids=["other-torch", "newer-minimum", "missing"])
def test_import_refuses_a_mismatched_or_missing_record(tmp_path, record):
    """A copy of the installed package whose record names another torch (or has none) fails
    to import with an ImportError, before the library is loaded."""
    package = Path(fastsafetensors_rs.__file__).parent
    copy = tmp_path / "fastsafetensors_rs"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    if record is None:
        (copy / _build_info.FILE).unlink()
    else:
        (copy / _build_info.FILE).write_text(json.dumps(record))
    proc = U.run_python("""
        import sys
        sys.path.insert(0, sys.argv[1])
        try:
            import fastsafetensors_rs
        except ImportError as e:
            print(e)
            print("fastsafetensors" in str(__import__("torch").ops.loaded_libraries))
        else:
            print("imported from", fastsafetensors_rs.__file__)
    """, tmp_path)
    out = U.check_output(proc)
    if record is None:
        assert f"{_build_info.FILE} (which torch the extension was compiled against) is missing" in out, out
    elif record.get("abi") == "stable":
        assert "needs torch>=2.99" in out and f"this environment has torch {torch.__version__}" in out, out
    else:
        assert f"compiled against torch 2.7.1+cu126, but this environment has torch {torch.__version__}" in out, out
    assert out.strip().endswith("False"), f"the library was loaded anyway:\n{out}"
