"""Deploying with TorchScript: the code ships as a scripted module, the weights stay a
.safetensors checkpoint that the module loads itself through `torch.ops.fastsafetensors.load`.

    python examples/torchscript_deploy.py [--workdir DIR]

1. builds a small MLP and saves its weights with safetensors (the "training" side);
2. scripts `Deployed`, whose `load_weights(files)` fills a Dict[str, Tensor] from the
   checkpoint with the op, and saves it with `torch.jit.save`;
3. in a fresh process that only loads the fastsafetensors library (no model code, no
   safetensors), runs `torch.jit.load(...)`, `load_weights([...])` and `forward`, and
   checks the output is bit-identical to the eager model's.

The same scripted module runs from C++ with `torch::jit::load` once the extension library
is loaded (see examples/cpp for calling the op from C++).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import warnings
from typing import Dict, List

import torch

import fastsafetensors_rs  # registers torch.ops.fastsafetensors


class MLP(torch.nn.Module):
    """The model as trained."""

    def __init__(self, d_in: int = 16, d_hidden: int = 64, d_out: int = 8):
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, d_hidden)
        self.fc2 = torch.nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Deployed(torch.nn.Module):
    """The same computation, with weights read from a checkpoint at start-up."""

    weights: Dict[str, torch.Tensor]

    def __init__(self, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weights = {}
        self.dtype = dtype

    @torch.jit.export
    def load_weights(self, files: List[str], device: str = "cpu") -> int:
        # One bulk read per file; floating tensors cast to the module's dtype on the device.
        names, tensors = torch.ops.fastsafetensors.load(files, device, self.dtype, None)
        self.weights = {name: t for name, t in zip(names, tensors)}
        return len(self.weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weights
        h = torch.nn.functional.gelu(torch.nn.functional.linear(x, w["fc1.weight"], w["fc1.bias"]))
        return torch.nn.functional.linear(h, w["fc2.weight"], w["fc2.bias"])


# Runs in the fresh process: nothing but torch and the op library.
DEPLOY_SIDE = textwrap.dedent(
    """
    import sys, torch
    library, module_path, checkpoint, inputs_path, out_path = sys.argv[1:6]
    torch.ops.load_library(library)          # registers torch.ops.fastsafetensors
    module = torch.jit.load(module_path)
    n = module.load_weights([checkpoint])
    y = module(torch.load(inputs_path))
    torch.save(y, out_path)
    print(f"deployed module loaded {n} tensors and ran: output {tuple(y.shape)}")
    """
)


def main() -> int:
    # TorchScript is deprecated upstream in favour of torch.export, but is what C++ deployments run.
    warnings.filterwarnings("ignore", message=r"`torch\.jit\..*` is deprecated", category=FutureWarning)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", help="where to write the files (default: a temporary directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or tmp
        os.makedirs(work, exist_ok=True)
        checkpoint = os.path.join(work, "mlp.safetensors")
        module_path = os.path.join(work, "deployed.pt")
        inputs_path = os.path.join(work, "inputs.pt")
        out_path = os.path.join(work, "outputs.pt")

        torch.manual_seed(0)
        model = MLP().eval()
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, checkpoint,
                  metadata={"format": "pt"})
        x = torch.randn(4, 16)
        torch.save(x, inputs_path)
        with torch.no_grad():
            expected = model(x)

        scripted = torch.jit.script(Deployed())
        torch.jit.save(scripted, module_path)

        proc = subprocess.run(
            [sys.executable, "-c", DEPLOY_SIDE, fastsafetensors_rs.LIBRARY_PATH, module_path, checkpoint,
             inputs_path, out_path],
            capture_output=True, text=True,
        )
        sys.stdout.write(proc.stdout)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr)
            return proc.returncode
        got = torch.load(out_path)
        identical = torch.equal(got, expected)
        print(json.dumps({"identical": identical, "checkpoint": checkpoint, "module": module_path}))
        return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
