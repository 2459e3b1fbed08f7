"""How the client tests run vLLM's and SGLang's own loader code, unmodified, on a machine
without a GPU, and the checkpoints they load.

Nothing of vLLM or SGLang is edited. Every place where the harness departs from a GPU run:

1. `VLLM_TARGET_DEVICE=cpu` (set below, before vLLM is imported): vLLM's own setting for its
   CPU platform. Without a GPU the CUDA wheel's platform detection gives
   `UnspecifiedPlatform`, on which building a model fails ("Invalid attention backend for
   None"); the loader code is the same on every platform.
2. `DeviceConfig(device="cpu")` in the engine configuration (`vllm_config()` below): the
   model is created in host memory.
3. `cuda_device_as_cpu(module)`: the weight iterators of vLLM
   (`weight_utils.fastsafetensors_weights_iterator`:
   `device = torch.device(f"cuda:{current_platform.current_device()}")`) and of SGLang
   (`weight_utils.fastsafetensors_weights_iterator`: `device = torch.device(f"cuda:{rank}")`)
   compute a CUDA device whatever the platform. While the patch is active, `torch.device`
   as seen from that one module turns a "cuda..." device into "cpu" (and records it);
   every other name of `torch` is torch's own. Where vLLM's platform has no
   `current_device` (vLLM before 0.33 ignores VLLM_TARGET_DEVICE=cpu in the CUDA wheel and
   stays on UnspecifiedPlatform), the module's `current_platform` answers it with 0. That
   is the only line it changes.
4. `sglang_server_args()`: SGLang's loader reads its settings from the process's published
   server configuration, which a server process publishes at start-up; the harness
   publishes SGLang's default (dummy) ServerArgs with SGLang's own test helper
   (`get_context().override_server_args()`).
"""

from __future__ import annotations

import json
import os
import tempfile
import types
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # 1.

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


# ---------------------------------------------------------------- 3. the CUDA device line


class _DeviceMeta(type):
    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, torch.device)


class _CudaAsCpu(types.ModuleType):
    """`torch` for one module, with `torch.device("cuda...")` giving the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.replaced: List[str] = []
        proxy = self

        class device(metaclass=_DeviceMeta):  # noqa: N801 - stands in for torch.device
            def __new__(cls, spec, *args, **kwargs):  # type: ignore[misc]
                if isinstance(spec, str) and spec.startswith("cuda"):
                    proxy.replaced.append(spec)
                    return torch.device("cpu")
                return torch.device(spec, *args, **kwargs)

        self.device = device

    def __getattr__(self, name: str):
        return getattr(torch, name)


class _PlatformWithDevice:
    """A platform whose missing `current_device` answers 0; everything else is the platform's."""

    def __init__(self, platform) -> None:
        self._platform = platform

    def current_device(self) -> int:
        return 0

    def __getattr__(self, name: str):
        return getattr(self._platform, name)


@contextmanager
def cuda_device_as_cpu(module: types.ModuleType) -> Iterator[List[str]]:
    """Within the block, `module` sees a `torch` whose `device("cuda:...")` is the CPU.
    Yields the list of device strings replaced, for the test to check the line was hit."""
    assert module.torch is torch, f"{module.__name__}.torch is not torch"
    proxy = _CudaAsCpu()
    platform = getattr(module, "current_platform", None)
    needs_device = platform is not None and getattr(platform, "current_device", None) is None
    module.torch = proxy
    if needs_device:
        module.current_platform = _PlatformWithDevice(platform)
    try:
        yield proxy.replaced
    finally:
        module.torch = torch
        if needs_device:
            module.current_platform = platform


# ---------------------------------------------------------------- checkpoints


def save_llama(directory: Path, scale: int = 1) -> Path:
    """A small Llama saved by transformers in 3 shards with model.safetensors.index.json
    (about 0.3 MB; `scale` times wider and `scale` squared times larger)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=512 * scale, hidden_size=64 * scale, intermediate_size=128 * scale, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(directory), max_shard_size=f"{100 * scale * scale}KB")
    shards = sorted(directory.glob("*.safetensors"))
    assert len(shards) >= 3 and (directory / "model.safetensors.index.json").is_file(), shards
    return directory


def save_bert(directory: Path) -> Path:
    """A small BERT saved by transformers as one model.safetensors."""
    import transformers

    torch.manual_seed(1)
    cfg = transformers.BertConfig(
        vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64,
    )
    transformers.BertModel(cfg).save_pretrained(str(directory))
    assert [p.name for p in directory.glob("*.safetensors")] == ["model.safetensors"]
    return directory


def reference(files) -> Dict[str, torch.Tensor]:
    """Every tensor of `files`, read by safetensors.torch.load_file."""
    out: Dict[str, torch.Tensor] = {}
    for f in files:
        part = load_file(str(f))
        assert not set(part) & set(out), f"duplicate names in {f}"
        out.update(part)
    return out


def checkpoint_files(directory: Path) -> List[str]:
    """The shards of a checkpoint: those the index lists, else every .safetensors file."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [str(directory / n) for n in names]
    return sorted(str(p) for p in directory.glob("*.safetensors"))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bit_exact(got: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor]) -> None:
    """Same names; each tensor the same dtype, shape and bytes, in host memory."""
    assert sorted(got) == sorted(expected), (
        f"names differ: missing {sorted(set(expected) - set(got))}, extra {sorted(set(got) - set(expected))}"
    )
    for name, want in expected.items():
        t = got[name]
        assert t.device.type == "cpu", f"{name}: on {t.device}"
        assert t.dtype == want.dtype and tuple(t.shape) == tuple(want.shape), (
            f"{name}: {t.dtype}{tuple(t.shape)} != {want.dtype}{tuple(want.shape)}"
        )
        assert torch.equal(as_bytes(t), as_bytes(want)), f"{name}: bytes differ"


def collect(pairs) -> Dict[str, torch.Tensor]:
    """A (name, tensor) iterator as a dict; a name yielded twice is an error."""
    out: Dict[str, torch.Tensor] = {}
    for name, t in pairs:
        assert name not in out, f"{name} yielded twice"
        out[name] = t
    return out


# ---------------------------------------------------------------- vLLM engine state


def vllm_version():
    import vllm
    from packaging.version import Version

    return Version(vllm.__version__)


def can_build_models_on_cpu() -> bool:
    """Whether this vLLM builds its model classes on its CPU platform from the CUDA wheel.
    Before 0.33, building calls ops of vLLM's CPU build that the CUDA wheel lacks (0.30:
    `torch.ops._C.silu_and_mul`; 0.22: "Invalid attention backend for None"); the loaders
    themselves run on every version."""
    from packaging.version import Version

    return vllm_version() >= Version("0.33")


def iterator_uses_parallel_loader(weight_utils) -> bool:
    """vLLM's fastsafetensors iterator uses ParallelLoader (0.24+) or SafeTensorsFileLoader."""
    import inspect

    return "ParallelLoader" in inspect.getsource(weight_utils.fastsafetensors_weights_iterator)


def vllm_config(model_dir: Path, load_format: str, extra: dict | None = None, dtype: str = "auto"):
    """vLLM's own ModelConfig / LoadConfig / VllmConfig for a local checkpoint (2.: cpu)."""
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig

    model_config = ModelConfig(model=str(model_dir), dtype=dtype, skip_tokenizer_init=True)
    load_config = LoadConfig(load_format=load_format, model_loader_extra_config=extra or {})
    return VllmConfig(model_config=model_config, load_config=load_config,
                      device_config=DeviceConfig(device="cpu"))


_distributed_ready = False


def init_vllm_distributed(config) -> None:
    """vLLM's process groups for one process (gloo), as a worker sets them up; once."""
    global _distributed_ready
    if _distributed_ready:
        return
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    init_file = Path(tempfile.mkdtemp(prefix="vllm-dist-")) / "init"
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"file://{init_file}", backend="gloo")
        initialize_model_parallel(1, 1)
    _distributed_ready = True


def load_vllm_model(model_dir: Path, load_format: str, extra: dict | None = None):
    """vLLM builds the model (its own class for the architecture) and loads it with the
    loader of `load_format`: `get_model_loader(...).load_model(...)`, as a worker does.
    Returns (model, loader)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    config = vllm_config(model_dir, load_format, extra)
    init_vllm_distributed(config)
    loader = get_model_loader(config.load_config)
    with set_current_vllm_config(config):
        model = loader.load_model(config, config.model_config)
    return model, loader


def sglang_server_args():
    """4.: SGLang's default ServerArgs, published for the duration of the block."""
    from sglang.srt.runtime_context import get_context

    return get_context().override_server_args()


def state(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------- IBM's package and subprocesses


def ibm_files_changed() -> List[str]:
    """Files of IBM's installed fastsafetensors whose content differs from its RECORD."""
    import base64
    import hashlib
    import importlib.metadata

    changed = []
    for entry in importlib.metadata.distribution("fastsafetensors").files or []:
        if entry.hash is None or entry.hash.mode != "sha256":
            continue  # RECORD itself, and files pip writes after the fact
        data = Path(entry.locate()).read_bytes()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        if digest != entry.hash.value:
            changed.append(str(entry))
    return changed


def run_scenario(*args: str, env: dict | None = None, timeout: float = 600) -> List[str]:
    """Runs scenarios.py in a fresh interpreter; returns its `CHECKED ...` lines."""
    import subprocess
    import sys

    here = Path(__file__).resolve().parent
    full_env = dict(os.environ)
    full_env.pop("FASTSAFETENSORS_INSTALL_AS_FASTSAFETENSORS", None)
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, str(here / "scenarios.py"), *args], env=full_env,
                          capture_output=True, text=True, timeout=timeout, cwd=str(here))
    assert proc.returncode == 0, f"scenarios.py {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return [line for line in proc.stdout.splitlines() if line.startswith("CHECKED ")]


def evict(path) -> None:
    """Drops a file's pages from the page cache (no root needed for a clean file)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_bytes() -> int:
    """Bytes this process has had fetched from storage (/proc/self/io)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise AssertionError("no read_bytes in /proc/self/io")


def run_ranks(client: str, model: Path, world: int, env: dict | None = None, timeout: float = 600,
              scenario: str = "ranks", args: tuple = ()) -> List[str]:
    """`world` processes of scenarios.py joined in one gloo group (each given `args` too);
    returns their CHECKED lines."""
    import subprocess
    import sys

    here = Path(__file__).resolve().parent
    init = Path(tempfile.mkdtemp(prefix="gloo-")) / "init"
    full_env = {**os.environ, **(env or {})}
    procs = [
        subprocess.Popen([sys.executable, str(here / "scenarios.py"), scenario, str(model), "--client", client,
                          "--rank", str(r), "--world", str(world), "--init", str(init), *args],
                         env=full_env, cwd=str(here), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(world)
    ]
    lines: List[str] = []
    failures = []
    for r, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        if p.returncode != 0:
            failures.append(f"rank {r} exited {p.returncode}\n{out}\n{err}")
        lines += [line for line in out.splitlines() if line.startswith("CHECKED ")]
    assert not failures, "\n".join(failures)
    return lines
