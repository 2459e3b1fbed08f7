"""The ops are usable from TorchScript, and scripted code that calls them can be saved and
run in another process. The scripted functions here are what a TorchScript caller writes:
`load` gives names beside tensors (a dict is one comprehension away), `metadata` keys beside
values, and a stream is a handle read with `stream_next` until it gives no names."""

from __future__ import annotations

import json
from typing import Dict, List, Optional, Tuple

import pytest
import torch
from safetensors.torch import load_file as st_load_file

import fastsafetensors_rs  # noqa: F401  (registers the ops)
import fst_testutils as U


@torch.jit.script
def scripted_load(files: List[str]) -> Dict[str, torch.Tensor]:
    names, tensors = torch.ops.fastsafetensors.load(files)
    return {name: t for name, t in zip(names, tensors)}


@torch.jit.script
def scripted_load_full(files: List[str], reader: str) -> Dict[str, torch.Tensor]:
    names, tensors = torch.ops.fastsafetensors.load(files, "cpu", None, reader)
    return {name: t for name, t in zip(names, tensors)}


@torch.jit.script
def scripted_load_as_float(files: List[str]) -> Dict[str, torch.Tensor]:
    names, tensors = torch.ops.fastsafetensors.load(files, device="cpu", dtype=torch.float32, reader="mmap")
    return {name: t for name, t in zip(names, tensors)}


@torch.jit.script
def scripted_report(files: List[str], reader: Optional[str]) -> Tuple[Dict[str, torch.Tensor], List[str]]:
    names, tensors, read_paths = torch.ops.fastsafetensors.load_with_report(files, "cpu", None, reader)
    return {name: t for name, t in zip(names, tensors)}, read_paths


@torch.jit.script
def scripted_inspect(file: str) -> Tuple[List[str], Dict[str, str]]:
    keys = torch.ops.fastsafetensors.keys(file)
    meta_keys, meta_values = torch.ops.fastsafetensors.metadata(file)
    meta: Dict[str, str] = {}
    if meta_keys is not None and meta_values is not None:
        meta = {k: v for k, v in zip(meta_keys, meta_values)}
    return keys, meta


@torch.jit.script
def scripted_stream(files: List[str], max_memory: str) -> Tuple[List[str], List[torch.Tensor], int]:
    stream = torch.ops.fastsafetensors.open_stream(files, "cpu", None, None, None, "glob", max_memory)
    count = torch.ops.fastsafetensors.stream_info(stream)[3]
    names: List[str] = []
    tensors: List[torch.Tensor] = []
    while True:
        group_names, group_tensors = torch.ops.fastsafetensors.stream_next(stream)
        if len(group_names) == 0:
            break  # the end; the stream closed itself (close_stream stops one early)
        names.extend(group_names)
        tensors.extend(group_tensors)
    return names, tensors, count


class Loader(torch.nn.Module):
    """A module whose forward loads a checkpoint and sums every floating tensor."""

    def __init__(self, reader: str):
        super().__init__()
        self.reader = reader

    def forward(self, files: List[str]) -> Tuple[Dict[str, torch.Tensor], torch.Tensor]:
        names, loaded = torch.ops.fastsafetensors.load(files, "cpu", None, self.reader)
        tensors = {name: t for name, t in zip(names, loaded)}
        total = torch.zeros([], dtype=torch.float64)
        for name in sorted(tensors.keys()):
            t = tensors[name]
            if t.is_floating_point():
                total = total + t.double().sum()
        return tensors, total


def _checkpoint(tmp_path):
    tensors = {
        "w": U.finite_tensor(torch.bfloat16, (16, 8), 1),
        "b": U.finite_tensor(torch.float32, (8,), 2),
        "ids": torch.arange(10, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "f8": U.finite_tensor(torch.float8_e4m3fn, (4, 4), 3),
    }
    path = U.write_checkpoint(tmp_path / "ts.safetensors", tensors, metadata={"format": "pt"})
    return path, tensors


@torch.jit.script
def scripted_save(tensors: Dict[str, torch.Tensor], path: str) -> List[str]:
    names = list(tensors.keys())
    return torch.ops.fastsafetensors.save(names, [tensors[n] for n in names], path, -1, ["format"], ["pt"])


def test_scripted_save_writes_what_safetensors_writes(tmp_path):
    from safetensors.torch import save_file as st_save_file

    tensors = {"w": U.random_tensor(torch.bfloat16, (33, 7), 1), "b": U.random_tensor(torch.int8, (5,), 2)}
    path = str(tmp_path / "scripted.safetensors")
    assert scripted_save(tensors, path) == [path]
    st_save_file(tensors, str(tmp_path / "stock.safetensors"), metadata={"format": "pt"})
    assert (tmp_path / "scripted.safetensors").read_bytes() == (tmp_path / "stock.safetensors").read_bytes()


def test_scripted_load(tmp_path):
    path, tensors = _checkpoint(tmp_path)
    U.assert_same_dict(scripted_load([str(path)]), st_load_file(str(path)))
    for reader in U.READERS:
        U.assert_same_dict(scripted_load_full([str(path)], reader), tensors)


def test_scripted_load_with_dtype(tmp_path):
    path, tensors = _checkpoint(tmp_path)
    got = scripted_load_as_float([str(path)])
    assert sorted(got) == sorted(tensors)
    U.assert_same_tensor(got["w"], tensors["w"].float(), "w")
    U.assert_same_tensor(got["b"], tensors["b"], "b")
    U.assert_same_tensor(got["ids"], tensors["ids"], "ids")
    U.assert_same_tensor(got["mask"], tensors["mask"], "mask")


def test_scripted_report_and_inspect(tmp_path):
    path, tensors = _checkpoint(tmp_path)
    got, paths = scripted_report([str(path)], "mmap")
    assert paths == ["mmap"]
    U.assert_same_dict(got, tensors)
    got, paths = scripted_report([str(path)], None)
    assert len(paths) == 1 and paths[0] in U.READ_PATHS
    keys, meta = scripted_inspect(str(path))
    assert keys == sorted(tensors)
    assert meta == {"format": "pt"}


def test_scripted_stream(tmp_path):
    path, tensors = _checkpoint(tmp_path)
    names, got, count = scripted_stream([str(path)], "1M")
    assert count == len(tensors) and sorted(names) == sorted(tensors)
    U.assert_same_dict(dict(zip(names, got)), tensors)
    # An early stop: close_stream, after which the handle is refused.
    ops = torch.ops.fastsafetensors
    stream = ops.open_stream([str(path)])
    assert len(ops.stream_next(stream)[0]) > 0
    assert ops.close_stream(stream) is True and ops.close_stream(stream) is False
    with pytest.raises(RuntimeError, match=f"stream {stream} is not open"):
        ops.stream_next(stream)


def test_scripted_errors_are_runtime_errors(tmp_path):
    bad = U.write_raw(tmp_path / "bad.safetensors", b"[]")
    with pytest.raises(RuntimeError) as info:
        scripted_load([str(bad)])
    assert str(bad) in str(info.value)
    with pytest.raises(RuntimeError):
        scripted_load_full([str(bad)], "nonsense")


def test_script_graph_calls_the_op():
    assert "fastsafetensors::load" in str(scripted_load.graph)


@pytest.mark.parametrize("reader", U.READERS)
def test_saved_module_runs_in_a_fresh_process(tmp_path, reader):
    path, tensors = _checkpoint(tmp_path)
    module = torch.jit.script(Loader(reader))
    got, total = module([str(path)])
    U.assert_same_dict(got, tensors)
    saved = tmp_path / "loader.pt"
    torch.jit.save(module, str(saved))

    proc = U.run_python(
        """
        import json, sys, torch
        import fastsafetensors_rs  # registers torch.ops.fastsafetensors
        from safetensors.torch import load_file
        import fst_testutils as U

        module = torch.jit.load(sys.argv[1])
        tensors, total = module([sys.argv[2]])
        ref = load_file(sys.argv[2])
        U.assert_same_dict(tensors, ref)
        want = sum(ref[k].double().sum() for k in sorted(ref) if ref[k].is_floating_point())
        assert torch.equal(total, want), (total, want)
        print(json.dumps({"keys": sorted(tensors), "total": total.item()}))
        """,
        saved, path,
    )
    result = json.loads(U.check_output(proc).strip().splitlines()[-1])
    assert result["keys"] == sorted(tensors)
    assert result["total"] == total.item()


def test_saved_function_runs_in_a_fresh_process(tmp_path):
    """A scripted free function survives save/load when wrapped in a module."""

    class Wrap(torch.nn.Module):
        def forward(self, files: List[str]) -> Tuple[Dict[str, torch.Tensor], List[str]]:
            return scripted_report(files, None)

    path, tensors = _checkpoint(tmp_path)
    saved = tmp_path / "wrap.pt"
    torch.jit.save(torch.jit.script(Wrap()), str(saved))
    proc = U.run_python(
        """
        import sys, torch, fastsafetensors_rs
        from safetensors.torch import load_file
        import fst_testutils as U
        tensors, paths = torch.jit.load(sys.argv[1])([sys.argv[2]])
        U.assert_same_dict(tensors, load_file(sys.argv[2]))
        assert len(paths) == 1 and paths[0] in ("mmap", "direct", "buffered"), paths
        print("ok")
        """,
        saved, path,
    )
    assert U.check_output(proc).strip().endswith("ok")
