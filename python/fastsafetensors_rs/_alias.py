"""`install_as_fastsafetensors()`: `import fastsafetensors` gives this package's compatible API.

Code written for IBM's fastsafetensors (vLLM's and SGLang's `--load-format fastsafetensors`,
TGIS-style loaders) imports `fastsafetensors`, `fastsafetensors.loader` and
`fastsafetensors.parallel_loader`. After `fastsafetensors_rs.install_as_fastsafetensors()`
those imports resolve, in this process, to `fastsafetensors_rs.compat` (the way PyMySQL's
`install_as_MySQLdb()` stands in for MySQLdb). IBM's package, installed or not, is never
modified: only the `sys.modules` entries of the names below are replaced.

- `fastsafetensors`: `SafeTensorsFileLoader`, `fastsafe_open`, `ParallelLoader`,
  `SingleGroup`, `FilesBufferOnDevice`, `DType`;
- `fastsafetensors.loader` (`fastsafetensors_rs.loader`) and `fastsafetensors.parallel_loader`
  (`fastsafetensors_rs.parallel_loader`).

That is everything vLLM 0.22-0.33 and SGLang 0.5 import. Other names of IBM's API
(`AutoLoader`, `fastsafetensors.common`, ...) raise an `AttributeError` / `ImportError` that
says they are not part of the compatible API.

If IBM's package was imported before the call, names that other modules already bound from
it (`from fastsafetensors import SingleGroup` at their import) keep referring to IBM's
objects: they are not rebound, and a `FastsafetensorsAliasWarning` lists them. IBM objects
already in use keep working: its other submodules stay loaded, and its package directory
stays on `fastsafetensors.__path__` for the submodules they import later. Call it before
importing the code that uses fastsafetensors.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
import types
import warnings
from typing import Any, Dict, List, Optional

from . import compat
from .compat import saver as _saver_module
from . import loader as _loader_module
from . import parallel_loader as _parallel_loader_module

__all__ = ["FastsafetensorsAliasWarning", "install_as_fastsafetensors"]

PACKAGE = "fastsafetensors"
_MIGRATION = "see docs/migration.md of fastsafetensors-rs"

# What `fastsafetensors` offers, and the submodules that stand in for IBM's.
_TOP_LEVEL = ("SafeTensorsFileLoader", "fastsafe_open", "ParallelLoader", "SingleGroup",
              "FilesBufferOnDevice", "DType", "ParallelSaver")
_SHIMS: Dict[str, types.ModuleType] = {
    "loader": _loader_module,
    "parallel_loader": _parallel_loader_module,
    "saver": _saver_module,
}

_lock = threading.Lock()
_installed: Optional[types.ModuleType] = None


class FastsafetensorsAliasWarning(UserWarning):
    """Names bound from IBM's fastsafetensors before `install_as_fastsafetensors()`."""


class _OtherSubmodules(importlib.abc.MetaPathFinder):
    """Answers imports of IBM's submodules that have no counterpart here with a clear error
    (consulted last, and only for submodules not already loaded)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname.startswith(PACKAGE + ".") and sys.modules.get(PACKAGE) is _installed is not None:
            provided = ", ".join(f"{PACKAGE}.{s}" for s in sorted(_SHIMS))
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: fastsafetensors_rs.install_as_fastsafetensors() "
                f"put its compatible API in place of IBM's fastsafetensors, which provides "
                f"{PACKAGE} and {provided}; {_MIGRATION}",
                name=fullname,
            )
        return None


def _build_modules(displaced_top: Optional[types.ModuleType]) -> Dict[str, types.ModuleType]:
    top = types.ModuleType(
        PACKAGE,
        "IBM fastsafetensors' API, provided by fastsafetensors_rs.compat "
        "(fastsafetensors_rs.install_as_fastsafetensors()).",
    )
    top.__spec__ = importlib.machinery.ModuleSpec(PACKAGE, None, origin=compat.__file__)
    top.__file__ = compat.__file__  # `from fastsafetensors import X` errors name it
    for attr in _TOP_LEVEL:
        setattr(top, attr, getattr(compat, attr))
    top.__all__ = list(_TOP_LEVEL)

    def __getattr__(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise AttributeError(
            f"{PACKAGE}.{attr} is not part of the compatible API that "
            f"fastsafetensors_rs.install_as_fastsafetensors() put in place of IBM's "
            f"fastsafetensors (it offers {', '.join(_TOP_LEVEL)}); {_MIGRATION}"
        )

    top.__getattr__ = __getattr__  # type: ignore[attr-defined]
    # A package, so that submodule imports reach _OtherSubmodules; where IBM's package was
    # loaded already, its directory stays searchable for the submodules its objects import
    # lazily (else they would break in use).
    top.__path__ = list(getattr(displaced_top, "__path__", None) or [])
    modules = {PACKAGE: top}
    for sub, shim in _SHIMS.items():
        modules[f"{PACKAGE}.{sub}"] = shim
        setattr(top, sub, shim)
    return modules


def _is_from(value: Any, displaced: Dict[str, types.ModuleType]) -> bool:
    """Whether `value` is one of the displaced modules or an object defined in IBM's package."""
    if isinstance(value, types.ModuleType):
        return any(value is m for m in displaced.values())
    try:
        owner = getattr(value, "__module__", None)
    except Exception:  # odd proxies (lazy placeholders) may raise on any attribute
        return False
    return isinstance(owner, str) and (owner == PACKAGE or owner.startswith(PACKAGE + "."))


def _still_bound(displaced: Dict[str, types.ModuleType]) -> List[str]:
    """`module.name` for every global of a loaded module that refers to IBM's fastsafetensors."""
    found = []
    for modname, module in list(sys.modules.items()):
        if modname == PACKAGE or modname.startswith(PACKAGE + ".") or module is None:
            continue
        try:
            namespace = vars(module)
        except TypeError:
            continue
        for attr, value in list(namespace.items()):
            if not attr.startswith("__") and _is_from(value, displaced):
                found.append(f"{modname}.{attr}")
    return sorted(found)


def install_as_fastsafetensors() -> None:
    """Makes `import fastsafetensors`, `fastsafetensors.loader` and
    `fastsafetensors.parallel_loader` give this package's compatible API for the rest of this
    process. Idempotent.

    Works whether or not IBM's fastsafetensors is installed, and whether or not it was
    imported already; IBM's package is never modified. Names other modules bound from IBM's
    package before this call stay IBM's (a `FastsafetensorsAliasWarning` names them), so call
    it before importing the code that uses fastsafetensors. Processes started later with
    `spawn` (and every other new interpreter) must call it again; vLLM's worker processes do
    so through the plugin when `FASTSAFETENSORS_INSTALL_AS_FASTSAFETENSORS=1` is set.
    """
    global _installed
    with _lock:
        if _installed is not None and sys.modules.get(PACKAGE) is _installed:
            return
        ours = {id(m) for m in (_installed, *_SHIMS.values())}
        # IBM's modules in the way (a facade of an earlier call that was removed is not).
        displaced = {
            name: sys.modules[name]
            for name in (PACKAGE, *(f"{PACKAGE}.{s}" for s in _SHIMS))
            if sys.modules.get(name) is not None and id(sys.modules[name]) not in ours
        }
        modules = _build_modules(displaced.get(PACKAGE))
        sys.modules.update(modules)
        _installed = modules[PACKAGE]
        if not any(isinstance(f, _OtherSubmodules) for f in sys.meta_path):
            sys.meta_path.append(_OtherSubmodules())
    if displaced:
        bound = _still_bound(displaced)
        if bound:
            shown = ", ".join(bound[:12]) + (f" and {len(bound) - 12} more" if len(bound) > 12 else "")
            warnings.warn(
                "install_as_fastsafetensors(): IBM's fastsafetensors was imported before; "
                f"these names still refer to it: {shown}. Call install_as_fastsafetensors() "
                "before importing the code that uses fastsafetensors.",
                FastsafetensorsAliasWarning,
                stacklevel=2,
            )
