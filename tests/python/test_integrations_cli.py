"""`python -m fastsafetensors_rs`: inspect, verify and bench, human and --json output, exit status."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import fastsafetensors_rs
import fastsafetensors_rs.progress as fst_progress
import fst_testutils as U
from fastsafetensors_rs import cli


def run(capsys, *argv):
    """Runs the CLI in-process; returns (exit status, stdout, stderr)."""
    rc = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def run_json(capsys, *argv):
    rc, out, err = run(capsys, *argv, "--json")
    return rc, json.loads(out), err


@pytest.fixture
def model_dir(tmp_path):
    """A sharded model directory with its index. Returns (dir, {file name: tensors})."""
    d = tmp_path / "model"
    d.mkdir()
    shards = {
        "model-00001-of-00002.safetensors": {
            "embed.weight": U.finite_tensor(torch.bfloat16, (64, 16), 1),
            "layers.0.weight": U.finite_tensor(torch.float32, (16, 16), 2),
        },
        "model-00002-of-00002.safetensors": {
            "layers.1.weight": U.random_tensor(torch.float8_e4m3fn, (16, 16), 3),
            "layers.1.scale": U.finite_tensor(torch.float32, (), 4),
            "packed": U.random_tensor(torch.float4_e2m1fn_x2, (4, 4), 5),
            "ids": torch.arange(7, dtype=torch.int64),
        },
    }
    weight_map = {}
    for fname, tensors in shards.items():
        U.write_checkpoint(d / fname, tensors, metadata={"format": "pt"})
        weight_map.update({k: fname for k in tensors})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d, shards


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ------------------------------------------------------------------------ inspect


def test_inspect_json_reports_the_headers(capsys, model_dir):
    d, shards = model_dir
    rc, doc, _ = run_json(capsys, "inspect", d)
    assert rc == 0 and doc["valid"] is True and doc["problems"] == []
    assert [Path(f["path"]).name for f in doc["files"]] == sorted(shards)
    assert doc["indexes"] == [str(d / "model.safetensors.index.json")]
    total_bytes = 0
    for f in doc["files"]:
        tensors = shards[Path(f["path"]).name]
        assert f["metadata"] == {"format": "pt"}
        assert f["file_bytes"] == os.path.getsize(f["path"])
        by_name = {t["name"]: t for t in f["tensors"]}
        assert sorted(by_name) == sorted(tensors)
        for name, t in tensors.items():
            entry = by_name[name]
            assert entry["dtype"] == U.DTYPE_NAME[t.dtype]
            shape = list(t.shape)
            if t.dtype in U.PACKED:
                shape[-1] *= 2  # safetensors counts fp4 elements, torch packs pairs
            assert entry["shape"] == shape
            assert entry["bytes"] == t.numel() * t.element_size()
        assert f["header_bytes"] + 8 + f["totals"]["bytes"] == f["file_bytes"]
        total_bytes += f["totals"]["bytes"]
    totals = doc["totals"]
    assert totals["files"] == 2 and totals["tensors"] == 6 and totals["bytes"] == total_bytes
    assert totals["by_dtype"]["F4"] == {"tensors": 1, "elements": 32, "bytes": 16}
    assert totals["by_dtype"]["F32"]["tensors"] == 2


def test_inspect_human_output(capsys, model_dir):
    d, _ = model_dir
    rc, out, _ = run(capsys, "inspect", d / "model-00002-of-00002.safetensors")
    assert rc == 0
    assert "layers.1.weight" in out and "F8_E4M3" in out and "[16, 16]" in out
    assert "metadata: format=pt" in out
    assert out.strip().endswith("valid")
    rc, out, _ = run(capsys, "inspect", "--summary", d)
    assert rc == 0 and "layers.1.weight" not in out and "total: 2 file(s), 6 tensors" in out


def test_inspect_reports_an_invalid_file(capsys, model_dir, tmp_path):
    d, _ = model_dir
    bad = U.write_raw(tmp_path / "bad.safetensors", b'{"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}',
                      b"\0" * 4)
    rc, doc, _ = run_json(capsys, "inspect", bad, d / "model-00001-of-00002.safetensors")
    assert rc == 1 and doc["valid"] is False
    bad_entry, good_entry = doc["files"]
    assert bad_entry["valid"] is False and str(bad) in bad_entry["error"]
    assert good_entry["valid"] is True
    rc, out, _ = run(capsys, "inspect", bad)
    assert rc == 1 and "INVALID" in out


@pytest.mark.parametrize("dtype", ["F6_E2M3", "F6_E3M2"])
def test_a_dtype_torch_lacks_is_one_line_and_the_other_files_are_still_reported(capsys, model_dir, tmp_path, dtype):
    """The format knows the dtype (the header is valid), torch has none to load it into."""
    d = _copy(model_dir[0], tmp_path / "with_f6")
    (d / "model.safetensors.index.json").unlink()
    f6 = U.write_raw(d / "model-00000-f6.safetensors", {"w": {"dtype": dtype, "shape": [4], "data_offsets": [0, 3]}},
                     b"\0" * 3)
    line = f"{f6}: tensor 'w': dtype {dtype} has no torch equivalent"
    for command in ("inspect", "verify"):
        rc, out, err = run(capsys, command, "--no-progress", d)
        assert rc == 1 and err == "", err
        assert out.count(line) == 1 and "Traceback" not in out, out
        assert out.count("\n    ") >= 1 and "model-00002-of-00002.safetensors" in out
        rc, doc, _ = run_json(capsys, command, d)
        assert rc == 1 and doc["valid"] is False
        by_path = {f["path"]: f for f in doc["files"]}
        assert by_path[str(f6)]["valid"] is False and by_path[str(f6)]["error"] == line
        assert len(by_path) == 3 and all(f["valid"] for p, f in by_path.items() if p != str(f6))


def test_same_names_in_separate_checkpoints_are_fine(capsys, model_dir, tmp_path):
    d, _ = model_dir
    other = _copy(d, tmp_path / "copy")
    rc, doc, _ = run_json(capsys, "inspect", d, other)
    assert rc == 0 and doc["problems"] == [] and doc["totals"]["files"] == 4


# ------------------------------------------------------------------------ verify


def test_verify_a_good_checkpoint(capsys, model_dir):
    d, _ = model_dir
    rc, doc, _ = run_json(capsys, "verify", d, "--reader", "mmap")
    assert rc == 0 and doc["valid"] is True
    assert [f["read_path"] for f in doc["files"]] == ["mmap", "mmap"]
    rc, out, _ = run(capsys, "verify", d / "model.safetensors.index.json")
    assert rc == 0 and "2 of 2 file(s) valid" in out


def test_verify_fails_on_a_truncated_shard(capsys, model_dir, tmp_path):
    d = _copy(model_dir[0], tmp_path / "broken")
    victim = d / "model-00002-of-00002.safetensors"
    victim.write_bytes(victim.read_bytes()[:-3])
    rc, doc, _ = run_json(capsys, "verify", d)
    assert rc == 1 and doc["valid"] is False
    bad = [f for f in doc["files"] if not f["valid"]]
    assert [f["path"] for f in bad] == [str(victim)] and str(victim) in bad[0]["error"]
    rc, out, _ = run(capsys, "verify", d)
    assert rc == 1 and "FAILED" in out and "1 of 2 file(s) valid" in out


def test_verify_checks_the_index(capsys, model_dir, tmp_path):
    d = _copy(model_dir[0], tmp_path / "misindexed")
    index = d / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["ids"] = "model-00001-of-00002.safetensors"  # it is in shard 2
    index.write_text(json.dumps(doc))
    rc, result, _ = run_json(capsys, "verify", d)
    assert rc == 1
    assert any("'ids'" in p and "model-00002-of-00002.safetensors" in p for p in result["problems"])

    del doc["weight_map"]["ids"]  # now the index does not list it
    index.write_text(json.dumps(doc))
    rc, result, _ = run_json(capsys, "verify", d)
    assert rc == 1 and any("does not list tensor 'ids'" in p for p in result["problems"])

    doc["weight_map"]["ids"] = "model-00003-of-00002.safetensors"  # a missing shard
    index.write_text(json.dumps(doc))
    rc, result, _ = run_json(capsys, "verify", d)
    assert rc == 1
    assert any(not f["valid"] and f["path"].endswith("00003-of-00002.safetensors") for f in result["files"])


def test_verify_finds_a_name_in_two_shards(capsys, tmp_path):
    d = tmp_path / "dup"
    d.mkdir()
    U.write_checkpoint(d / "a.safetensors", {"w": torch.zeros(2)})
    U.write_checkpoint(d / "b.safetensors", {"w": torch.ones(2)})
    rc, doc, _ = run_json(capsys, "verify", d)
    assert rc == 1 and any("'w' is in both" in p for p in doc["problems"])


def test_usage_errors(capsys, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, _, err = run(capsys, "inspect", empty)
    assert rc == 2 and "no *.safetensors files and no *.safetensors.index.json in this directory" in err
    rc, _, err = run(capsys, "verify", tmp_path / "missing.index.json")
    assert rc == 2
    with pytest.raises(SystemExit) as info:
        cli.main(["verify", "x.safetensors", "--reader", "telepathy"])
    assert info.value.code == 2
    assert cli.main([]) == 2
    capsys.readouterr()


def test_verify_progress_bar(capsys, model_dir, monkeypatch):
    pytest.importorskip("tqdm")
    d, _ = model_dir
    monkeypatch.setattr(fst_progress, "DELAY_S", 0)
    monkeypatch.delenv(fst_progress.ENV_PROGRESS, raising=False)
    rc, _, err = run(capsys, "verify", d)
    assert rc == 0 and "verifying" in err  # on by default in the command line tool
    rc, _, err = run(capsys, "verify", d, "--no-progress")
    assert rc == 0 and "verifying" not in err
    monkeypatch.setenv(fst_progress.ENV_PROGRESS, "0")
    rc, _, err = run(capsys, "verify", d)
    assert rc == 0 and "verifying" not in err


# ------------------------------------------------------------------------ bench


def test_bench_json(capsys, model_dir):
    d, _ = model_dir
    rc, doc, _ = run_json(capsys, "bench", d, "--repeat", "2", "--no-progress")
    assert rc == 0
    assert doc["bytes"] == sum(os.path.getsize(p) for p in doc["files"])
    got = {(r["mode"], r["loader"]): r for r in doc["results"]}
    assert set(got) == {(m, l) for m in ("cold", "warm") for l in ("fastsafetensors_rs", "safetensors")}
    for r in got.values():
        assert len(r["seconds"]) == 2 and r["median_s"] > 0 and r["gb_per_s"] > 0
    assert got[("warm", "fastsafetensors_rs")]["speedup_vs_safetensors"] > 0
    rc, doc, _ = run_json(capsys, "bench", d, "--repeat", "1", "--modes", "warm", "--no-safetensors",
                          "--reader", "direct")
    assert rc == 0 and [(r["mode"], r["loader"]) for r in doc["results"]] == [("warm", "fastsafetensors_rs")]
    assert doc["reader"] == "direct"


def test_bench_save_times_saving_the_checkpoint_again(capsys, model_dir, tmp_path, monkeypatch):
    d, _ = model_dir
    out = tmp_path / "saved"
    kept = {}
    real_save = __import__("fastsafetensors_rs.saving", fromlist=["save"]).save

    def keep(tensors, directory, **kwargs):  # what the last save wrote, before the bench removes it
        paths = real_save(tensors, directory, **kwargs)
        kept.update(fastsafetensors_rs.load(directory))
        return paths

    monkeypatch.setattr("fastsafetensors_rs.saving.save", keep)
    rc, doc, _ = run_json(capsys, "bench", d, "--repeat", "2", "--modes", "warm", "--save", str(out), "--no-progress")
    assert rc == 0
    got = {(r["mode"], r["loader"]): r for r in doc["results"]}
    assert {("save", "fastsafetensors_rs"), ("save", "safetensors")} <= set(got)
    assert len(got[("save", "safetensors")]["seconds"]) == 2 and got[("save", "fastsafetensors_rs")]["gb_per_s"] > 0
    assert got[("save", "fastsafetensors_rs")]["speedup_vs_safetensors"] > 0
    reference = fastsafetensors_rs.load(str(d))
    assert sorted(kept) == sorted(reference)
    for name, t in reference.items():
        U.assert_same_tensor(kept[name], t, name)
    assert not out.exists()


def test_bench_human_and_errors(capsys, model_dir, tmp_path):
    d, _ = model_dir
    rc, out, _ = run(capsys, "bench", d, "--repeat", "1", "--modes", "warm")
    assert rc == 0 and "GB/s" in out and "x safetensors" in out
    bad = U.write_raw(tmp_path / "bad.safetensors", b"[]")
    rc, _, err = run(capsys, "bench", bad)
    assert rc == 1 and str(bad) in err


@pytest.mark.parametrize("argv, message", [
    (["--modes", ""], "argument --modes: no mode given (cold, warm, or cold,warm)"),
    (["--modes", " , "], "argument --modes: no mode given (cold, warm, or cold,warm)"),
    (["--modes", "warm,lukewarm"], "argument --modes: unknown mode 'lukewarm' (cold, warm)"),
    (["--repeat", "0"], "argument --repeat: must be at least 1, got 0"),
    (["--repeat", "-2"], "argument --repeat: must be at least 1, got -2"),
    (["--repeat", "many"], "argument --repeat: expected a whole number of runs, got 'many'"),
])
def test_bench_refuses_a_run_of_nothing_with_its_own_usage(capsys, model_dir, argv, message):
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", str(model_dir[0]), *argv])
    out = capsys.readouterr()
    assert info.value.code == 2 and out.out == ""
    assert out.err.startswith("usage: python -m fastsafetensors_rs bench ")
    assert out.err.endswith(f"\npython -m fastsafetensors_rs bench: error: {message}\n"), out.err


def test_bench_columns_line_up(capsys, model_dir):
    rc, out, _ = run(capsys, "bench", model_dir[0], "--repeat", "1", "--no-progress")
    rows = [line for line in out.splitlines() if "GB/s" in line]
    assert rc == 0 and len(rows) == 4, out
    for word in (" ms ", " GB/s"):
        assert len({row.index(word) for row in rows}) == 1, out


def test_bench_names_a_bad_file_once(capsys, tmp_path):
    bad = U.write_raw(tmp_path / "bad.safetensors", b"[]")
    missing = tmp_path / "missing.safetensors"
    for path in (bad, missing):
        rc, out, err = run(capsys, "bench", path)
        assert rc == 1 and out == ""
        message = f"No such file or directory: {path}" if path == missing else f"{path}: "
        assert err.count(str(path)) == 1 and err.startswith(f"python -m fastsafetensors_rs bench: {message}"), err
        assert err.count("\n") == 1, err


@pytest.mark.parametrize("command", ["inspect", "verify", "bench"])
def test_json_output_is_a_document_even_when_the_command_fails(capsys, tmp_path, command):
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, out, err = run(capsys, command, empty, "--json")
    message = f"{empty}: no *.safetensors files and no *.safetensors.index.json in this directory"
    assert rc == 2 and err.startswith(f"python -m fastsafetensors_rs {command}: {message}")
    doc = json.loads(out)
    assert doc == {"command": command, "valid": False, "error": err.split(": ", 1)[1].rstrip("\n")}


def test_bench_and_verify_on_a_device_that_is_not_there(model_dir):
    """One line and exit status 2, not a traceback (here: no GPU; on a GPU machine, an index
    past the last device)."""
    import subprocess
    import sys

    d, _ = model_dir
    count = torch.cuda.device_count()
    device = "cuda" if count == 0 else f"cuda:{count}"
    want = ("no CUDA device is visible (torch.cuda.device_count() is 0)" if count == 0
            else f"there is no CUDA device {count} (torch sees {count})")
    for command in ("bench", "verify"):
        proc = subprocess.run([sys.executable, "-m", "fastsafetensors_rs", command, str(d), "--device", device],
                              capture_output=True, text=True, env=U.subprocess_env(), timeout=120)
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr == f"python -m fastsafetensors_rs {command}: --device {device}: {want}\n"
    proc = subprocess.run([sys.executable, "-m", "fastsafetensors_rs", "bench", str(d), "--device", "cpu:1"],
                          capture_output=True, text=True, env=U.subprocess_env(), timeout=120)
    assert proc.returncode == 2 and proc.stderr == (
        "python -m fastsafetensors_rs bench: --device cpu:1: fastsafetensors: cannot load to device 'cpu:1': "
        "there is one CPU device, 'cpu'\n")


def test_a_load_failing_in_bench_is_one_line(capsys, model_dir, monkeypatch):
    d, _ = model_dir

    def failing(*args, **kwargs):
        raise RuntimeError("fastsafetensors: cannot load to cuda:0: CUDA: the CUDA driver (libcuda.so.1) is not installed")

    monkeypatch.setattr(cli.api, "load", failing)
    rc, out, err = run(capsys, "bench", d, "--repeat", "1", "--modes", "warm", "--no-safetensors")
    assert rc == 1 and out == ""
    assert err == ("python -m fastsafetensors_rs bench: fastsafetensors: cannot load to cuda:0: CUDA: the CUDA driver "
                   "(libcuda.so.1) is not installed\n")


@pytest.fixture(scope="module")
def long_outputs(tmp_path_factory):
    """Inputs whose listing is far longer than a pipe holds (64 KiB): a file of 5000 tensors
    (inspect) and a directory of 1500 files (verify: one line per file)."""
    d = tmp_path_factory.mktemp("long")
    many = U.write_checkpoint(d / "many.safetensors", {f"layer.{i}.weight": torch.zeros(2) for i in range(5000)})
    files = d / "files"
    files.mkdir()
    for i in range(1500):
        U.write_checkpoint(files / f"part-{i:05d}-of-a-checkpoint-with-long-names.safetensors", {f"w{i}": torch.ones(1)})
    return many, files


def _piped(argv, close_at_once=False):
    """Runs the CLI with stdout into a pipe whose reader takes one line (or nothing) and
    leaves, as `| head -1` does; returns (first line, exit status, stderr)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "fastsafetensors_rs", *map(str, argv)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=U.subprocess_env())
    first = b"" if close_at_once else proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.wait(timeout=300)
    return first, proc.returncode, err


@pytest.mark.parametrize("case", ["inspect", "inspect_json", "verify"])
def test_output_piped_into_head_ends_quietly(long_outputs, case):
    """The tool stops with status 141 (as tools killed by SIGPIPE do) and prints nothing."""
    many, files = long_outputs
    argv = {"inspect": ["inspect", many], "inspect_json": ["inspect", "--json", many],
            "verify": ["verify", "--no-progress", "--reader", "mmap", files]}[case]
    first, rc, err = _piped(argv)
    assert first and rc == 141 and err == "", (rc, err)


def test_bench_into_a_closed_pipe_ends_quietly(model_dir):
    """bench writes its report at the end, after the reader is gone."""
    first, rc, err = _piped(["bench", model_dir[0], "--repeat", "1", "--modes", "warm", "--no-progress"],
                            close_at_once=True)
    assert rc == 141 and err == "", (rc, err)


def test_inspect_summary_json_lists_no_tensors(capsys, model_dir):
    d, _ = model_dir
    rc, doc, _ = run_json(capsys, "inspect", "--summary", d)
    assert rc == 0 and doc["totals"]["tensors"] == 6
    assert all("tensors" not in f and f["totals"]["tensors"] > 0 for f in doc["files"])
    rc, full, _ = run_json(capsys, "inspect", d)
    assert all(len(f["tensors"]) == f["totals"]["tensors"] for f in full["files"])
    assert {k: v for k, v in full.items() if k != "files"} == {k: v for k, v in doc.items() if k != "files"}


# ------------------------------------------------------------------------ python -m


def test_python_dash_m(model_dir, tmp_path):
    d, _ = model_dir
    proc = U.run_python("import runpy; runpy.run_module('fastsafetensors_rs', run_name='__main__')")
    assert proc.returncode == 2 and "inspect" in proc.stderr
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "fastsafetensors_rs", "inspect", "--json", str(d)],
                          capture_output=True, text=True, env=U.subprocess_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["totals"]["tensors"] == 6
    bad = U.write_raw(tmp_path / "bad.safetensors", b"[]")
    proc = subprocess.run([sys.executable, "-m", "fastsafetensors_rs", "verify", "-v", str(bad)],
                          capture_output=True, text=True, env=U.subprocess_env(), timeout=120)
    assert proc.returncode == 1 and str(bad) in proc.stdout
