"""The build backend: setuptools' own, with one rule added first.

The extension is C++ compiled against torch's headers and linked against its libraries: for
torch 2.8 to 2.10 against that torch release's C++ API, which changes between minor releases,
and from torch 2.11 on against its stable ABI (targeting 2.11, so that the library also
loads under every later torch). Either way it is compiled against the headers of the torch
installed in the target environment. pip's default build isolation
hides that torch and would have to download another one (about 3 GB, whatever version is
newest) to compile against. So building a wheel where torch cannot be imported fails at once,
before anything is downloaded or compiled, and says how to build instead. A source
distribution needs no torch and builds anywhere.
"""

from __future__ import annotations

import importlib.util
import re

from setuptools import build_meta as _setuptools
from setuptools.build_meta import build_sdist, get_requires_for_build_sdist  # noqa: F401  (passed through)

NO_TORCH = """
fastsafetensors-rs compiles a torch extension against the torch installed in the environment
that will import it, and no torch can be imported here. (With torch 2.11 or newer there is
nothing to compile: the prebuilt wheel serves every such torch,
`pip install --only-binary fastsafetensors-rs fastsafetensors-rs`.)

If you ran pip with its default build isolation, build in your environment instead:

    pip install --no-build-isolation fastsafetensors-rs     (or: pip install --no-build-isolation .)

(install torch>=2.8, setuptools and wheel into that environment first). Build isolation would
compile against a freshly downloaded torch rather than yours, and an extension built for
another torch release fails to load.
"""


def _require_torch() -> None:
    if importlib.util.find_spec("torch") is None:
        raise SystemExit(NO_TORCH)


def _require_wheel_support() -> None:
    """setuptools before 70.1 builds wheels only with the `wheel` package, which a fresh venv
    lacks; without it the build would fail late with "invalid command 'bdist_wheel'"."""
    import setuptools

    release = tuple(int(part) for part in re.findall(r"\d+", setuptools.__version__)[:2])
    if release < (70, 1) and importlib.util.find_spec("wheel") is None:
        raise SystemExit(
            f"fastsafetensors-rs: setuptools {setuptools.__version__} needs the `wheel` package to build "
            "a wheel: `pip install wheel` (or `pip install -U setuptools`) in this environment, then retry"
        )


def get_requires_for_build_wheel(config_settings=None):
    _require_torch()
    return _setuptools.get_requires_for_build_wheel(config_settings)


def get_requires_for_build_editable(config_settings=None):
    _require_torch()
    return _setuptools.get_requires_for_build_editable(config_settings)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    # setuptools < 70.1 makes this metadata with bdist_wheel too.
    _require_wheel_support()
    return _setuptools.prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    _require_wheel_support()
    return _setuptools.prepare_metadata_for_build_editable(metadata_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _require_torch()
    _require_wheel_support()
    return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    _require_torch()
    _require_wheel_support()
    return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
