"""Scenarios that need a fresh interpreter (the order of imports matters, or several ranks):
vLLM's and SGLang's own fastsafetensors weight iterators running on this package through
`install_as_fastsafetensors()`. Run by the tests as

    python scenarios.py SCENARIO MODEL_DIR [options]

Each scenario checks every tensor bit-exactly against safetensors.torch.load_file itself and
prints one `CHECKED <what> <count>` line per check; any failure is a traceback and exit 1.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Dict, List

import harness  # sets VLLM_TARGET_DEVICE before vLLM is imported

import torch
import torch.distributed as dist


def ibm_package_dir() -> Path:
    dist_ = importlib.metadata.distribution("fastsafetensors")
    return Path(dist_.locate_file("fastsafetensors")).resolve()


def ibm_modules_loaded() -> List[str]:
    """Modules of IBM's fastsafetensors present in this process."""
    root = ibm_package_dir()
    out = []
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and Path(file).resolve().is_relative_to(root):
            out.append(name)
    return sorted(out)


def spy_parallel_loader() -> List[Dict[str, Any]]:
    """Records the arguments of every ParallelLoader this package builds."""
    from fastsafetensors_rs.compat import parallel

    calls: List[Dict[str, Any]] = []
    original = parallel.ParallelLoader.__init__

    def init(self, pg, hf_weights_files, *args, **kwargs):
        calls.append({"pg": type(pg).__module__ + "." + type(pg).__name__,
                      "files": list(hf_weights_files), **kwargs})
        original(self, pg, hf_weights_files, *args, **kwargs)

    parallel.ParallelLoader.__init__ = init
    return calls


def check(what: str, got: Dict[str, torch.Tensor], files) -> None:
    harness.assert_bit_exact(got, harness.reference(files))
    print(f"CHECKED {what} {len(got)}", flush=True)


def install(order: str, importer) -> Any:
    """Installs the opt-in before or after the client's weight_utils is imported; returns
    that module. After, the names it bound from IBM's package must be reported."""
    import fastsafetensors_rs

    if order == "install-first":
        fastsafetensors_rs.install_as_fastsafetensors()
        return importer()
    module = importer()
    assert ibm_modules_loaded(), "IBM's fastsafetensors should have been imported by the client"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fastsafetensors_rs.install_as_fastsafetensors()
    messages = [str(w.message) for w in caught
                if issubclass(w.category, fastsafetensors_rs.FastsafetensorsAliasWarning)]
    assert len(messages) == 1 and f"{module.__name__}.SingleGroup" in messages[0], messages
    print("CHECKED warning-names-bound-before 1", flush=True)
    return module


# ---------------------------------------------------------------- vLLM


def vllm_weight_utils():
    from vllm.model_executor.model_loader import weight_utils

    return weight_utils


def vllm_builtin(args) -> None:
    """`--load-format fastsafetensors`: vLLM's fastsafetensors_weights_iterator and
    DefaultModelLoader, on this package."""
    import fastsafetensors_rs

    weight_utils = install(args.order, vllm_weight_utils)
    calls = spy_parallel_loader()
    files = harness.checkpoint_files(Path(args.model))
    parallel = harness.iterator_uses_parallel_loader(weight_utils)
    for queue_size in ("0", "2", "-1") if parallel else ("",):
        os.environ["VLLM_FASTSAFETENSORS_QUEUE_SIZE"] = queue_size or "0"
        with harness.cuda_device_as_cpu(weight_utils) as replaced:
            got = harness.collect(weight_utils.fastsafetensors_weights_iterator(files, False))
        assert replaced and all(d.startswith("cuda") for d in replaced), replaced
        if parallel:
            assert calls[-1]["queue_size"] == int(queue_size) and calls[-1]["device"] == "cpu", calls[-1]
        check(f"weights_iterator-queue{queue_size}" if parallel else "weights_iterator", got, files)
    if args.order == "install-first":
        assert weight_utils.SingleGroup is fastsafetensors_rs.SingleGroup
        assert not ibm_modules_loaded(), ibm_modules_loaded()
        print("CHECKED ibm-never-imported 1", flush=True)

    # The whole loader: get_model_loader(LoadConfig(load_format="fastsafetensors")).
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    config = harness.vllm_config(Path(args.model), "fastsafetensors")
    from vllm.model_executor.model_loader import get_model_loader

    loader = get_model_loader(config.load_config)
    assert type(loader) is DefaultModelLoader
    with harness.cuda_device_as_cpu(weight_utils):
        got = harness.collect(loader.get_all_weights(config.model_config, torch.nn.Module()))
    check("get_all_weights", got, files)
    if args.load_model:
        with harness.cuda_device_as_cpu(weight_utils):
            model, _ = harness.load_vllm_model(Path(args.model), "fastsafetensors")
        expected, _ = harness.load_vllm_model(Path(args.model), "safetensors")
        harness.assert_bit_exact(harness.state(model), harness.state(expected))
        print(f"CHECKED load_model-vs-safetensors {len(harness.state(model))}", flush=True)
    assert calls or not parallel, "vLLM never built this package's ParallelLoader"


def vllm_plugin_env(args) -> None:
    """FASTSAFETENSORS_INSTALL_AS_FASTSAFETENSORS=1: vLLM's plugin loading installs the
    opt-in before vLLM's loader modules are imported."""
    assert os.environ.get("FASTSAFETENSORS_INSTALL_AS_FASTSAFETENSORS") == "1"
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    import fastsafetensors

    import fastsafetensors_rs

    assert fastsafetensors.SafeTensorsFileLoader is fastsafetensors_rs.SafeTensorsFileLoader
    weight_utils = vllm_weight_utils()
    assert weight_utils.SingleGroup is fastsafetensors_rs.SingleGroup
    files = harness.checkpoint_files(Path(args.model))
    with harness.cuda_device_as_cpu(weight_utils):
        got = harness.collect(weight_utils.fastsafetensors_weights_iterator(files, False))
    check("plugin-env-weights_iterator", got, files)
    assert not ibm_modules_loaded(), ibm_modules_loaded()
    print("CHECKED ibm-never-imported 1", flush=True)


# ---------------------------------------------------------------- SGLang


def sglang_weight_utils():
    from sglang.srt.model_loader import weight_utils

    return weight_utils


def sglang_builtin(args) -> None:
    """SGLang's `--load-format fastsafetensors` weight iterator, on this package."""
    import fastsafetensors_rs

    weight_utils = install(args.order, sglang_weight_utils)
    if args.order == "install-first":
        assert weight_utils.SafeTensorsFileLoader is fastsafetensors_rs.SafeTensorsFileLoader
        assert weight_utils.SingleGroup is fastsafetensors_rs.SingleGroup
        gds_settings = (True, False)
    else:
        # SGLang bound IBM's classes at its import: they stay IBM's, and keep working after
        # the opt-in (IBM's submodules stay loaded). Without GDS: no cuFile on this machine.
        assert weight_utils.SafeTensorsFileLoader.__module__ == "fastsafetensors.loader"
        gds_settings = (False,)
    files = harness.checkpoint_files(Path(args.model))
    for enable_gds in gds_settings:
        with harness.cuda_device_as_cpu(weight_utils) as replaced:
            got = harness.collect(weight_utils.fastsafetensors_weights_iterator(files, enable_gds=enable_gds))
        assert replaced, "SGLang's device line was not reached"
        check(f"sglang-weights_iterator-gds{enable_gds}", got, files)
    if args.order != "install-first":
        return
    # SGLang's DefaultModelLoader with LoadConfig(load_format="fastsafetensors").
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import DefaultModelLoader

    with harness.sglang_server_args():
        loader = DefaultModelLoader(LoadConfig(load_format="fastsafetensors"))
        source = DefaultModelLoader.Source(args.model, None)
        with harness.cuda_device_as_cpu(weight_utils):
            got = harness.collect(loader._get_weights_iterator(source))
    check("sglang-DefaultModelLoader", got, files)
    assert not ibm_modules_loaded(), ibm_modules_loaded()
    print("CHECKED ibm-never-imported 1", flush=True)


# ---------------------------------------------------------------- ranks


def ranks(args) -> None:
    """One of several gloo ranks running the client's iterator over the whole checkpoint."""
    import fastsafetensors_rs

    fastsafetensors_rs.install_as_fastsafetensors()
    weight_utils = vllm_weight_utils() if args.client == "vllm" else sglang_weight_utils()
    dist.init_process_group("gloo", init_method=f"file://{args.init}", rank=args.rank,
                            world_size=args.world)
    try:
        calls = spy_parallel_loader()
        files = harness.checkpoint_files(Path(args.model))
        with harness.cuda_device_as_cpu(weight_utils):
            if args.client == "vllm":
                got = harness.collect(weight_utils.fastsafetensors_weights_iterator(files, False))
                if harness.iterator_uses_parallel_loader(weight_utils):
                    assert calls and calls[-1]["pg"].startswith("torch"), calls
                    assert calls[-1]["nogds"] is True, calls[-1]  # vLLM: nogds for TP > 1
            else:
                got = harness.collect(weight_utils.fastsafetensors_weights_iterator(files))
        check(f"{args.client}-rank{args.rank}-of-{args.world}", got, files)
    finally:
        dist.destroy_process_group()


def plugin_tp(args) -> None:
    """One rank of a vLLM engine with tensor parallelism over `--world` ranks on the CPU: vLLM's
    own process groups (gloo), then the plugin's loader over the whole checkpoint, its files
    evicted from the page cache first; prints the bytes this rank read from storage. With
    `--verify DIGESTS` (a JSON file of the files' digests) the load is verified, the reads still
    shared, and the bytes this rank hashed are printed too; a wrong digest is printed as the
    error every rank raised, with the names the load yielded before it."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    model = Path(args.model)
    from fastsafetensors_rs.distributed import verified_bytes

    extra = {"verify": {"digests": json.loads(Path(args.verify).read_text())}} if args.verify else None
    config = harness.vllm_config(model, "fastsafetensors_rs", extra)
    files = harness.checkpoint_files(model)
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=args.world, rank=args.rank, local_rank=args.rank,
                                     distributed_init_method=f"file://{args.init}", backend="gloo")
        initialize_model_parallel(args.world, 1)
        loader = get_model_loader(config.load_config)

        seen: list = []  # the names the last load yielded, in order

        def load():
            seen.clear()
            pairs = loader.get_all_weights(config.model_config, torch.nn.Module())
            return harness.collect((seen.append(name) or (name, t) for name, t in pairs))

        try:
            load()  # once unmeasured, so that the code this loads from disk is not counted below
            if args.rank == 0:
                for f in files:
                    harness.evict(f)
            dist.barrier()
            before, hashed = harness.read_bytes(), verified_bytes()
            got = load()
        except RuntimeError as e:
            print(f"CHECKED error {' '.join(str(e).split())}")
            print(f"CHECKED yielded {' '.join(seen)}")
            return
        finally:
            # vLLM's groups ended before the interpreter: left to its exit, gloo's threads can
            # abort it ("terminate called without an active exception") after a failed load.
            destroy_model_parallel()
            destroy_distributed_environment()
        read, hashed = harness.read_bytes() - before, verified_bytes() - hashed
    check(f"vllm-plugin-tp-rank{args.rank}-of-{args.world}", got, files)
    print(f"CHECKED read_bytes {read}")
    print(f"CHECKED hashed_bytes {hashed}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["vllm-builtin", "vllm-plugin-env", "sglang-builtin", "ranks",
                                                 "plugin-tp"])
    parser.add_argument("model")
    parser.add_argument("--order", choices=["install-first", "client-first"], default="install-first")
    parser.add_argument("--load-model", action="store_true")
    parser.add_argument("--client", choices=["vllm", "sglang"], default="vllm")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--init", default="")
    parser.add_argument("--verify", default="", help="plugin-tp: a JSON file of the files' digests")
    args = parser.parse_args()
    {"vllm-builtin": vllm_builtin, "vllm-plugin-env": vllm_plugin_env,
     "sglang-builtin": sglang_builtin, "ranks": ranks, "plugin-tp": plugin_tp}[args.scenario](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
