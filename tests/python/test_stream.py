"""Selective and streaming loads: `tensor_filter` on `load`/`load_file`/`safe_open`/the op,
`safe_open(...).tensors()` and `fastsafetensors_rs.stream`, row reads through `get_slice`,
the memory budget and its environment variable, and the ends of a stream: early `break`, a
consumer that raises, a file that changes, selections that select nothing or names that
are in no file."""

from __future__ import annotations

import gc
import json
import logging
import os
import re

import pytest
import torch
from safetensors import safe_open as st_safe_open

import fastsafetensors_rs
import fst_testutils as U

ops = torch.ops.fastsafetensors
MiB = 1 << 20

# Filters over the multi_file_model fixture, and the names each selects.
FILTERS = {
    "glob": (["model.layers.1.*", "lm_head.weight"], "glob"),
    "regex": ([r"\.weight$", r"expert_ids"], "regex"),
    "exact": (["model.norm.weight", "model.layers.0.input_layernorm.weight", "model.rotary.mask"], "exact"),
}


def expected_names(shards, patterns, mode):
    import fnmatch
    import re

    names = [n for shard in shards for n in shard]
    if mode == "glob":
        return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    if mode == "regex":
        return [n for n in names if any(re.search(p, n) for p in patterns)]
    return [n for n in names if n in patterns]


def written(shards):
    return {name: t for shard in shards for name, t in shard.items()}


def read_order(paths):
    """Names in file order, then offset order within each file."""
    return [n for p in paths for n in ops.describe(str(p))[0]]


# ---------------------------------------------------------------- bit-exactness


@pytest.mark.parametrize("reader", U.READERS)
@pytest.mark.parametrize("mode", list(FILTERS))
def test_every_reader_and_filter_mode_is_bit_exact(multi_file_model, reader, mode):
    paths, shards = multi_file_model
    patterns, match = FILTERS[mode]
    want = expected_names(shards, patterns, match)
    assert want, "the filter selects something"
    everything = written(shards)
    # Batch loads: the op, load, load_file.
    got = U.op_load([str(p) for p in paths], "cpu", None, reader, None, patterns, match)
    assert sorted(got) == sorted(want)
    got = fastsafetensors_rs.load(paths, reader=reader, tensor_filter=patterns, tensor_name_match_mode=match)
    U.assert_same_dict(got, {n: everything[n] for n in want})
    for p, shard in zip(paths, shards):
        # Exact names must be in the files loaded: give each file its own.
        own = [n for n in patterns if n in shard] if match == "exact" else patterns
        part = fastsafetensors_rs.load_file(p, reader=reader, tensor_filter=own, tensor_name_match_mode=match)
        U.assert_same_dict(part, {n: t for n, t in shard.items() if n in want})
    # Streams, in read order, with a budget small enough that groups wait for the consumer.
    for max_memory in (1, "64K", None, "unlimited"):
        with fastsafetensors_rs.safe_open(paths, tensor_filter=patterns, tensor_name_match_mode=match,
                                          max_memory=max_memory, reader=reader) as f:
            assert f.keys() == sorted(want)
            streamed = list(f.tensors())
        assert [n for n, _ in streamed] == [n for n in read_order(paths) if n in want], max_memory
        for name, t in streamed:
            U.assert_same_tensor(t, everything[name], name)


@pytest.mark.parametrize("reader", U.READERS)
def test_every_dtype_streams_bit_exact(all_dtypes_file, reader):
    path, tensors = all_dtypes_file
    with st_safe_open(str(path), "pt") as ref, fastsafetensors_rs.safe_open(path, reader=reader) as f:
        streamed = dict(f.tensors())
        assert sorted(streamed) == sorted(ref.keys())
        for name in ref.keys():
            U.assert_same_tensor(streamed[name], ref.get_tensor(name), name)
            U.assert_same_tensor(f.get_tensor(name), ref.get_tensor(name), name)


def test_callable_filter_selects_what_it_returns_true_for(multi_file_model):
    paths, shards = multi_file_model
    pick = lambda name: name.endswith("bias") or name.startswith("lm_")  # noqa: E731
    want = {n: t for n, t in written(shards).items() if pick(n)}
    U.assert_same_dict(fastsafetensors_rs.load(paths, tensor_filter=pick), want)
    with fastsafetensors_rs.safe_open(paths, tensor_filter=pick) as f:
        assert f.keys() == sorted(want)
        U.assert_same_dict(dict(f.tensors()), want)


def test_dtype_cast_applies_to_streams_and_filtered_loads(multi_file_model):
    paths, shards = multi_file_model
    ref = written(shards)
    loaded = fastsafetensors_rs.load(paths, dtype=torch.float32, tensor_filter="*")
    streamed = dict(fastsafetensors_rs.stream(paths, dtype=torch.float32))
    for name, want in ref.items():
        cast = want.to(torch.float32) if want.dtype in (torch.bfloat16, torch.float16) else want
        for got in (loaded[name], streamed[name]):
            assert got.dtype == cast.dtype, name
            assert torch.equal(U.as_bytes(got), U.as_bytes(cast)), name


def test_torchscript_can_filter_and_stream(multi_file_model):
    paths, shards = multi_file_model

    @torch.jit.script
    def scripted(files: list[str]) -> dict[str, torch.Tensor]:
        names, tensors = torch.ops.fastsafetensors.load(files, tensor_filter=["model.layers.1.*"])
        out = {name: t for name, t in zip(names, tensors)}
        stream = torch.ops.fastsafetensors.open_stream(files, max_memory="1M")
        done = False
        while not done:
            names, tensors = torch.ops.fastsafetensors.stream_next(stream)
            if len(names) == 0:
                done = True
            for i in range(len(names)):
                out["streamed." + names[i]] = tensors[i]
        return out

    got = scripted([str(p) for p in paths])
    ref = written(shards)
    assert sorted(n for n in got if not n.startswith("streamed.")) == sorted(shards[1])
    for name, t in ref.items():
        U.assert_same_tensor(got["streamed." + name], t, name)


# ---------------------------------------------------------------- safe_open over several files


def test_safe_open_over_several_files(multi_file_model):
    paths, shards = multi_file_model
    ref = written(shards)
    with fastsafetensors_rs.safe_open(paths) as f:
        assert f.keys() == sorted(ref)
        assert f.offset_keys() == read_order(paths)
        assert f.metadata() == {"format": "pt", "shard": "0"}, "the first file's metadata"
        for name in reversed(f.keys()):
            U.assert_same_tensor(f.get_tensor(name), ref[name], name)
        assert f.get_slice("lm_head.weight").get_shape() == [64, 32]
    with pytest.raises(RuntimeError, match="closed"):
        f.tensors()


def test_names_repeated_across_files_are_rejected(tmp_path):
    a = U.write_checkpoint(tmp_path / "a.safetensors", {"w": torch.ones(2)})
    b = U.write_checkpoint(tmp_path / "b.safetensors", {"w": torch.zeros(2)})
    with pytest.raises(RuntimeError, match="'w' is in both .*a.safetensors and .*b.safetensors"):
        fastsafetensors_rs.safe_open([a, b])
    with pytest.raises(RuntimeError, match="'w' is in both"):
        fastsafetensors_rs.stream([a, b])


def test_unselected_names_are_not_there(multi_file_model):
    paths, _ = multi_file_model
    with fastsafetensors_rs.safe_open(paths[0], tensor_filter="*.q_proj.*") as f:
        assert f.keys() == ["model.layers.0.self_attn.q_proj.weight"]
        with pytest.raises(KeyError, match="not selected by tensor_filter 'model.embed_tokens.weight'"):
            f.get_tensor("model.embed_tokens.weight")
        with pytest.raises(KeyError, match="no tensor named 'nope'"):
            f.get_slice("nope")


def test_get_tensor_streams_the_file_once_for_many_threads(tmp_path, monkeypatch):
    import threading

    import fastsafetensors_rs.api as api

    path = U.write_checkpoint(tmp_path / "t.safetensors", {f"w{i}": torch.full((4096,), float(i)) for i in range(64)})
    opened = []
    real = api._open_stream
    monkeypatch.setattr(api, "_open_stream", lambda *a: opened.append(a) or real(*a))
    with fastsafetensors_rs.safe_open(path, max_memory="64K") as f:
        results = {}
        names = f.keys()
        threads = [threading.Thread(target=lambda n=n: results.__setitem__(n, f.get_tensor(n))) for n in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(opened) == 1
    for i in range(64):
        assert torch.equal(results[f"w{i}"], torch.full((4096,), float(i)))


@pytest.mark.parametrize("source", ["stream", "safe_open.tensors"])
def test_one_iterator_shared_by_threads_hands_out_each_tensor_once(tmp_path, source):
    """Threads taking turns on one iterator get every tensor exactly once between them, and
    none of them fails, as with any iterator shared under a lock."""
    import threading

    path = U.write_checkpoint(tmp_path / "med.safetensors",
                              {f"t{i:02d}": torch.full((64 * 1024,), i, dtype=torch.uint8) for i in range(64)})
    for _ in range(5):
        if source == "stream":
            it = fastsafetensors_rs.stream(path, max_memory="1M")
        else:
            it = fastsafetensors_rs.safe_open(path, max_memory="1M").tensors()
        got, errors = [], []
        start = threading.Barrier(4)

        def consume():
            start.wait()
            try:
                for name, t in it:
                    assert torch.equal(t, torch.full((64 * 1024,), int(name[1:]), dtype=torch.uint8)), name
                    got.append(name)
            except Exception as e:  # reported below: no thread may fail
                errors.append(repr(e))

        threads = [threading.Thread(target=consume) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert sorted(got) == [f"t{i:02d}" for i in range(64)]
        assert next(it, None) is None  # exhausted for every thread


# ---------------------------------------------------------------- rows


@pytest.mark.parametrize("reader", U.READERS)
def test_row_slices_read_only_their_rows(tmp_path, reader):
    w = U.random_tensor(torch.bfloat16, (4096, 256), 3)  # 2 MiB, 512 bytes a row
    path = U.write_checkpoint(tmp_path / "w.safetensors", {"a": U.random_tensor(torch.int8, (5000,), 1), "w": w})
    for index in (slice(1024, 2048), slice(4000, None), (slice(7, 9), slice(3, 5)), slice(10, 10), slice(-3, None)):
        with fastsafetensors_rs.safe_open(path, reader=reader) as f:
            U.assert_same_tensor(f.get_slice("w")[index], w[index].contiguous(), str(index))
    code = """
        import sys, fastsafetensors_rs
        import fst_testutils as U
        U.make_cold(sys.argv[1])
        def read_bytes():
            return int(next(l for l in open("/proc/self/io") if l.startswith("read_bytes")).split()[1])
        before = read_bytes()
        with fastsafetensors_rs.safe_open(sys.argv[1], reader=sys.argv[2]) as f:
            rows = f.get_slice("w")[1024:1536]
        print(read_bytes() - before, rows.nbytes)
    """
    out = U.check_output(U.run_python(code, path, reader)).split()
    read, wanted = int(out[0]), int(out[1])
    assert wanted == 512 * 512
    if reader != "mmap":  # a mapping reads what is touched, and readahead decides how much
        assert read <= wanted + 2 * 4096 + 16384, f"{read} bytes read for {wanted} bytes of rows"


def test_load_rows_op_checks_the_range(tmp_path):
    path = U.write_checkpoint(tmp_path / "r.safetensors", {"w": torch.arange(12.0).reshape(4, 3), "s": torch.ones(())})
    assert torch.equal(ops.load_rows(str(path), "w", 1, 3), torch.arange(3.0, 9.0).reshape(2, 3))
    with pytest.raises(RuntimeError, match=r"has 4 rows; rows \[2, 5\)"):
        ops.load_rows(str(path), "w", 2, 5)
    with pytest.raises(RuntimeError, match="negative row index"):
        ops.load_rows(str(path), "w", -1, 2)
    with pytest.raises(RuntimeError, match="scalar"):
        ops.load_rows(str(path), "s", 0, 1)


# ---------------------------------------------------------------- selections that select nothing, or too much


def test_a_filter_that_selects_nothing_gives_nothing_and_says_so(multi_file_model, caplog):
    paths, _ = multi_file_model
    with caplog.at_level(logging.WARNING, logger="fastsafetensors_rs"):
        assert fastsafetensors_rs.load(paths, tensor_filter="no.such.*") == {}
        assert list(fastsafetensors_rs.stream(paths, tensor_filter=["^nothing$"], tensor_name_match_mode="regex")) == []
        with fastsafetensors_rs.safe_open(paths, tensor_filter=[]) as f:
            assert f.keys() == [] and list(f.tensors()) == []
    assert sum("selects no tensor" in r.message for r in caplog.records) >= 3


def test_names_in_no_file_are_listed(multi_file_model):
    paths, _ = multi_file_model
    names = ["model.norm.weight", "lm_head.bias", "model.layers.7.mlp.weight"]
    pattern = r"tensor_filter names 2 tensors that are in none of the files .*'lm_head.bias', 'model.layers.7.mlp.weight'"
    for call in (
        lambda: fastsafetensors_rs.load(paths, tensor_filter=names, tensor_name_match_mode="exact"),
        lambda: fastsafetensors_rs.stream(paths, tensor_filter=names, tensor_name_match_mode="exact"),
        lambda: fastsafetensors_rs.safe_open(paths, tensor_filter=names, tensor_name_match_mode="exact"),
        lambda: U.op_load([str(p) for p in paths], tensor_filter=names, tensor_name_match_mode="exact"),
    ):
        with pytest.raises(RuntimeError, match=pattern):
            call()


def test_bad_filter_arguments_are_clear_errors(multi_file_model):
    paths, _ = multi_file_model
    with pytest.raises(ValueError, match="tensor_name_match_mode='fnmatch'"):
        fastsafetensors_rs.load(paths, tensor_filter="*", tensor_name_match_mode="fnmatch")
    with pytest.raises(RuntimeError, match="unknown tensor_name_match_mode 'fnmatch'"):
        U.op_load([str(paths[0])], tensor_filter=["*"], tensor_name_match_mode="fnmatch")
    with pytest.raises(ValueError, match=re.escape("pattern 'layers\\.(' is not valid: unclosed group (at character 9)")):
        fastsafetensors_rs.load(paths, tensor_filter=r"layers\.(", tensor_name_match_mode="regex")
    with pytest.raises(TypeError, match="expected names or patterns"):
        fastsafetensors_rs.load(paths, tensor_filter=["a", 3])


# ---------------------------------------------------------------- the memory budget


def test_max_memory_arguments_and_environment_are_validated(multi_file_model, monkeypatch):
    paths, shards = multi_file_model
    for bad, error in ((-1, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match="max_memory"):
            fastsafetensors_rs.stream(paths, max_memory=bad)
    with pytest.raises(ValueError, match=r"max_memory='lots' is not valid: expected bytes"):
        fastsafetensors_rs.stream(paths, max_memory="lots")
    monkeypatch.setenv("FASTSAFETENSORS_MAX_MEMORY", "12 parsecs")
    with pytest.raises(RuntimeError, match=r"FASTSAFETENSORS_MAX_MEMORY='12 parsecs' is not valid"):
        fastsafetensors_rs.stream(paths)
    # A malformed setting fails every load, whatever it would have been used for.
    with pytest.raises(RuntimeError, match=r"FASTSAFETENSORS_MAX_MEMORY='12 parsecs' is not valid"):
        fastsafetensors_rs.load(paths)
    # A good variable is taken, and the argument wins over it.
    monkeypatch.setenv("FASTSAFETENSORS_MAX_MEMORY", "256K")
    U.assert_same_dict(dict(fastsafetensors_rs.stream(paths)), written(shards))
    U.assert_same_dict(dict(fastsafetensors_rs.stream(paths, max_memory="1MiB")), written(shards))


STREAM_CHILD = """
import gc, json, os, sys, time
import torch, fastsafetensors_rs
import fst_testutils as U
path, mode, max_memory = sys.argv[1], sys.argv[2], sys.argv[3]
U.make_cold(path)

def read_bytes():
    return int(next(l for l in open("/proc/self/io") if l.startswith("read_bytes")).split()[1])

def stream_threads():
    return sum(open(f"/proc/self/task/{t}/comm").read().strip() == "fastsafetensors-stream"
               for t in os.listdir("/proc/self/task"))

def status(field):
    return 1024 * int(next(l for l in open("/proc/self/status") if l.startswith(field + ":")).split()[1])

def rss():
    return status("VmRSS")

def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak RSS, to the current RSS

base = rss()
reset_peak()
out = {}
if mode == "consume":
    # Copy each tensor into a preallocated parameter, as transformers and vLLM do.
    names, dtypes, shapes, *_ = torch.ops.fastsafetensors.describe(path)
    params = {n: torch.zeros(s, dtype=torch.uint8) for n, s in zip(names, shapes)}
    base = rss()
    reset_peak()
    count = 0
    for name, t in fastsafetensors_rs.stream(path, reader="direct", max_memory=max_memory):
        params[name].copy_(t)
        count += 1
    out["count"] = count
elif mode in ("break", "raise"):
    it = fastsafetensors_rs.stream(path, reader="direct", max_memory=max_memory)
    try:
        for name, t in it:
            if mode == "raise":
                raise KeyError("consumer failed on " + name)
            break
    except KeyError as e:
        out["raised"] = str(e)
    del it
    gc.collect()
    time.sleep(0.3)
    out["threads_after"] = stream_threads()
    first = read_bytes()
    time.sleep(0.5)
    out["read_after_stop"] = read_bytes() - first
out["read"] = read_bytes()
out["peak_delta"] = status("VmHWM") - base
out["rss_delta"] = rss() - base
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def big_file(tmp_path_factory):
    """128 MiB in 64 tensors of 2 MiB: a file large enough for a budget to matter."""
    if not U.supports_o_direct(tmp_path_factory.getbasetemp()):
        pytest.skip("the temporary directory does not support O_DIRECT (tmpfs)")
    path = tmp_path_factory.mktemp("big") / "big.safetensors"
    U.write_checkpoint(path, {f"t{i:02d}": torch.full((2 * MiB,), i % 251, dtype=torch.uint8) for i in range(64)})
    return path


def test_a_consumer_that_copies_stays_within_the_budget(big_file):
    out = json.loads(U.check_output(U.run_python(STREAM_CHILD, big_file, "consume", "16M")))
    assert out["count"] == 64
    # Peak RSS over the baseline: at most the budget, the largest tensor and 64 MiB of slack.
    assert out["peak_delta"] <= 16 * MiB + 2 * MiB + 64 * MiB, out


@pytest.mark.parametrize("how", ["break", "raise"])
def test_leaving_early_stops_the_reads_and_frees_everything(big_file, how):
    out = json.loads(U.check_output(U.run_python(STREAM_CHILD, big_file, how, "8M")))
    if how == "raise":
        assert "consumer failed on t00" in out["raised"]
    assert out["threads_after"] == 0, "the stream's scheduler is joined"
    assert out["read_after_stop"] == 0, "no read goes on after the stream is closed"
    assert out["read"] < 32 * MiB, f"read {out['read']} bytes of a 128 MiB file before stopping"
    assert out["rss_delta"] < 24 * MiB, out


def test_a_file_that_changes_mid_stream_is_an_error(tmp_path):
    tensors = {f"t{i}": torch.full((64 * 1024,), i, dtype=torch.int32) for i in range(16)}
    path = U.write_checkpoint(tmp_path / "c.safetensors", tensors)
    for reader in ("direct", "mmap"):
        U.write_checkpoint(path, tensors)
        # A budget of one byte: each group is read only when the consumer asks for it.
        it = fastsafetensors_rs.stream(path, reader=reader, max_memory=1)
        name, first = next(it)
        assert torch.equal(first, tensors[name])
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        with pytest.raises(RuntimeError, match=r"c\.safetensors: (file changed while|file ended at)"):
            for _ in it:
                pass


def test_loads_larger_than_the_host_memory_limit_map_what_does_not_fit(tmp_path):
    # Files large enough that reading a header does not bring the whole file in with it.
    shards = [{f"s{k}.w{i}": U.random_tensor(torch.uint8, (4 * MiB,), 10 * k + i) for i in range(3)} for k in range(3)]
    paths = [U.write_checkpoint(tmp_path / f"m{k}.safetensors", shard) for k, shard in enumerate(shards)]
    code = """
        import json, sys, fastsafetensors_rs, torch
        import fst_testutils as U
        paths = sys.argv[1:]
        for p in paths:
            U.make_cold(p)
        tensors, read_paths = U.op_load_with_report(paths)
        sums = {n: int(t.view(torch.uint8).sum()) for n, t in tensors.items()}
        try:
            torch.ops.fastsafetensors.load(paths, reader="direct")
            error = None
        except RuntimeError as e:
            error = str(e)
        print(json.dumps({"read_paths": read_paths, "error": error, "sums": sums}))
    """
    proc = U.run_python(code, *paths, env={"FASTSAFETENSORS_MAX_HOST_MEMORY": "20M"})
    out = json.loads(U.check_output(proc).splitlines()[-1])
    assert out["sums"] == {n: int(t.sum()) for n, t in written(shards).items()}
    assert out["read_paths"][0] == U.expected_direct_path(tmp_path), "the file that fits is read"
    assert out["read_paths"][1:] == ["mmap-fallback", "mmap-fallback"], out
    assert out["error"] and "FASTSAFETENSORS_MAX_HOST_MEMORY" in out["error"], "an explicit direct reader fails"
