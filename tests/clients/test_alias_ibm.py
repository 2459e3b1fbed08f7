"""`fastsafetensors_rs.install_as_fastsafetensors()` with IBM's fastsafetensors 0.5.0 really
installed in the same environment (vLLM 0.33 requires it). Each case runs in a fresh
interpreter: the opt-in changes `sys.modules` for the whole process."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import textwrap
from pathlib import Path

import harness

HERE = Path(__file__).resolve().parent


def run(code: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True,
                          text=True, timeout=300, cwd=str(HERE))
    assert proc.returncode == 0, f"exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_ibm_package_is_installed():
    assert importlib.metadata.version("fastsafetensors") == "0.5.0"


def test_without_the_opt_in_fastsafetensors_is_ibms(bert):
    out = run("""
        import sys, fastsafetensors_rs, fastsafetensors
        from fastsafetensors.parallel_loader import ParallelLoader
        assert fastsafetensors.__version__ == "0.5.0"
        assert "site-packages/fastsafetensors/" in fastsafetensors.__file__
        assert fastsafetensors.SafeTensorsFileLoader is not fastsafetensors_rs.SafeTensorsFileLoader
        assert ParallelLoader.__module__ == "fastsafetensors.parallel_loader"
        print("IBM")
    """)
    assert out.split() == ["IBM"]


def test_opt_in_before_ibm_is_imported(bert):
    """All of IBM's names that clients import resolve to the compatible API; IBM's package is
    never imported; loads are bit-exact; a second call changes nothing."""
    out = run("""
        import sys, warnings, torch
        import harness, scenarios
        import fastsafetensors_rs
        fastsafetensors_rs.install_as_fastsafetensors()
        import fastsafetensors, fastsafetensors.loader, fastsafetensors.parallel_loader
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup, fastsafe_open, ParallelLoader
        from fastsafetensors.parallel_loader import ParallelLoader as PL
        from fastsafetensors.loader import SafeTensorsFileLoader as STFL
        assert SafeTensorsFileLoader is STFL is fastsafetensors_rs.SafeTensorsFileLoader
        assert ParallelLoader is PL is fastsafetensors_rs.ParallelLoader
        assert SingleGroup is fastsafetensors_rs.SingleGroup
        assert fastsafetensors.loader is sys.modules["fastsafetensors.loader"] is fastsafetensors_rs.loader

        files = harness.checkpoint_files(harness.Path(sys.argv[1]))
        with fastsafe_open(files, device="cpu", nogds=True) as f:
            got = {k: f.get_tensor(k) for k in f.keys()}
        harness.assert_bit_exact(got, harness.reference(files))
        pl = PL(SingleGroup(), files, device="cpu")
        harness.assert_bit_exact(harness.collect(pl.iterate_weights()), harness.reference(files))
        pl.close()

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            before = sys.modules["fastsafetensors"]
            fastsafetensors_rs.install_as_fastsafetensors()
            assert sys.modules["fastsafetensors"] is before
        assert scenarios.ibm_modules_loaded() == [], scenarios.ibm_modules_loaded()

        try:
            fastsafetensors.AutoLoader
        except AttributeError as e:
            assert "not part of the compatible API" in str(e), e
        else:
            raise AssertionError("AutoLoader")
        try:
            import fastsafetensors.cpp
        except ModuleNotFoundError as e:
            assert "fastsafetensors.cpp" in str(e) and "compatible API" in str(e), e
        else:
            raise AssertionError("fastsafetensors.cpp")
        print("OURS", len(got))
    """, str(bert))
    assert out.split()[0] == "OURS"


def test_opt_in_after_ibm_was_imported(bert):
    """IBM's package imported first, and a module bound a name from it: the opt-in replaces
    the modules, leaves the bound name alone and says so; the IBM objects already in hand
    keep working (IBM's lazy imports still find its files)."""
    out = run("""
        import sys, types, warnings
        import harness
        import fastsafetensors as ibm
        client = types.ModuleType("client_code")
        exec("from fastsafetensors import SingleGroup, fastsafe_open", client.__dict__)
        sys.modules["client_code"] = client

        import fastsafetensors_rs
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fastsafetensors_rs.install_as_fastsafetensors()
        messages = [str(w.message) for w in caught
                    if w.category is fastsafetensors_rs.FastsafetensorsAliasWarning]
        assert len(messages) == 1, messages
        assert "client_code.SingleGroup" in messages[0] and "client_code.fastsafe_open" in messages[0], messages

        import fastsafetensors
        from fastsafetensors.parallel_loader import ParallelLoader
        assert fastsafetensors is not ibm
        assert fastsafetensors.fastsafe_open is fastsafetensors_rs.fastsafe_open
        assert ParallelLoader is fastsafetensors_rs.ParallelLoader
        assert client.SingleGroup.__module__ == "fastsafetensors.common"  # still IBM's

        files = harness.checkpoint_files(harness.Path(sys.argv[1]))
        with client.fastsafe_open(files, device="cpu", nogds=True) as f:   # IBM's, in use
            got = {k: f.get_tensor(k).clone() for k in f.keys()}
        harness.assert_bit_exact(got, harness.reference(files))
        with fastsafetensors.fastsafe_open(files, device="cpu") as f:        # ours
            harness.assert_bit_exact({k: f.get_tensor(k) for k in f.keys()}, harness.reference(files))
        print("BOTH", len(got))
    """, str(bert))
    assert out.split()[0] == "BOTH"


def test_ibms_loader_reads_the_shards_the_compatible_saver_writes(bert, tmp_path):
    """`fastsafetensors_rs.compat.saver.save_sharded` writes IBM's shard set: IBM's own
    `validate_shard_set` accepts it, IBM's `fastsafe_open` reads it bit-exact, and IBM's
    `save_sharded` puts the same tensors in each shard."""
    out = run("""
        import sys, harness
        from fastsafetensors import fastsafe_open, saver as ibm
        from fastsafetensors.common import SafeTensorsMetadata
        from fastsafetensors.frameworks import get_framework_op
        from fastsafetensors_rs.compat import saver as ours

        ref = harness.reference(harness.checkpoint_files(harness.Path(sys.argv[1])))
        paths = ours.save_sharded([ours.plain_entry(k, v) for k, v in ref.items()], sys.argv[2] + "/ours/model",
                                  num_shards=3, metadata={"format": "pt"})
        ibm.validate_shard_set([SafeTensorsMetadata.from_file(p, get_framework_op("pytorch")) for p in paths])
        with fastsafe_open(paths, device="cpu", nogds=True) as f:
            harness.assert_bit_exact({k: f.get_tensor(k).clone() for k in f.keys()}, ref)
        theirs = ibm.save_sharded([ibm.plain_entry(k, v) for k, v in ref.items()], sys.argv[2] + "/ibm/model",
                                  num_shards=3, fsync=True, metadata={"format": "pt"})
        for a, b in zip(paths, theirs):
            names = []
            for path in (a, b):
                with fastsafe_open([path], device="cpu", nogds=True) as f:
                    names.append(sorted(f.keys()))
            assert names[0] == names[1], names
        print("SHARDS", len(paths))
    """, str(bert), str(tmp_path))
    assert out.split() == ["SHARDS", "3"]


def test_ibms_files_are_untouched():
    """Every file of IBM's package still matches the hashes pip recorded at install."""
    assert harness.ibm_files_changed() == []
