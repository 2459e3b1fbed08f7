"""`fastsafetensors_rs.install_as_fastsafetensors()` where IBM's fastsafetensors is not
installed (this environment). With IBM's 0.5.0 installed beside it, in both import
orders: tests/clients/test_alias_ibm.py (`make test-vllm`). Each case runs in a fresh
interpreter: the opt-in changes `sys.modules` for the whole process."""

from __future__ import annotations

import importlib.util

import fst_testutils as U


def test_ibm_package_is_absent_here():
    assert importlib.util.find_spec("fastsafetensors") is None


def test_import_fastsafetensors_needs_the_opt_in():
    out = U.check_output(U.run_python("""
        import fastsafetensors_rs
        try:
            import fastsafetensors
        except ModuleNotFoundError:
            print("absent")
    """))
    assert out.split() == ["absent"]


def test_opt_in_gives_the_compatible_api(multi_file_model):
    paths, shards = multi_file_model
    out = U.check_output(U.run_python("""
        import sys, warnings
        from safetensors.torch import load_file
        import fst_testutils as U
        import fastsafetensors_rs
        fastsafetensors_rs.install_as_fastsafetensors()

        import fastsafetensors
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup, fastsafe_open, DType
        from fastsafetensors.loader import SafeTensorsFileLoader as STFL
        from fastsafetensors.parallel_loader import ParallelLoader
        assert SafeTensorsFileLoader is STFL is fastsafetensors_rs.SafeTensorsFileLoader
        assert ParallelLoader is fastsafetensors_rs.ParallelLoader
        assert SingleGroup is fastsafetensors_rs.SingleGroup and DType is fastsafetensors_rs.DType
        assert fastsafetensors.parallel_loader is fastsafetensors_rs.parallel_loader

        files = sys.argv[1:]
        expected = {}
        for f in files:
            expected.update(load_file(f))
        pl = ParallelLoader(SingleGroup(), files, device="cpu")
        U.assert_same_dict(dict(pl.iterate_weights()), expected)
        with fastsafe_open(files) as f:
            U.assert_same_dict({k: f.get_tensor(k) for k in f.keys()}, expected)

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            module = sys.modules["fastsafetensors"]
            fastsafetensors_rs.install_as_fastsafetensors()   # idempotent, silent
            assert sys.modules["fastsafetensors"] is module

        try:
            fastsafetensors.AutoLoader
        except AttributeError as e:
            assert "not part of the compatible API" in str(e), e
            print("no AutoLoader")
        try:
            from fastsafetensors import AutoLoader
        except ImportError as e:
            assert "fastsafetensors_rs/compat" in str(e), e
            print("no AutoLoader here")
        for name in ("fastsafetensors.common", "fastsafetensors.cpp"):
            try:
                __import__(name)
            except ModuleNotFoundError as e:
                assert name in str(e) and "install_as_fastsafetensors" in str(e), e
                print("no", name)
        print("loaded", len(expected))
    """, *paths))
    assert out.splitlines() == ["no AutoLoader", "no AutoLoader here", "no fastsafetensors.common", "no fastsafetensors.cpp",
                                f"loaded {sum(len(s) for s in shards)}"]
