"""What a verified load checks its bytes against: `Signature`, `Digests`, or `True`.

Every entry point that loads (`load`, `load_file`, `stream`, `safe_open`, `weights_iterator`,
the fastsafetensors-compatible loader) takes `verify=`:

- `Signature("model.sig", public_key="key.pub")` (or `certificate_chain=[...]`, or
  `identity=..., issuer=...` for a keyless Sigstore bundle): an OpenSSF model-signing signature
  (`model_signing sign key|certificate|sigstore`), checked offline; every file loaded must be
  listed in it and hash to what it lists.
- `Digests({"model.safetensors": "sha256:<hex>", ...})`: digests the caller trusts.
- `True`: what the files' location carries: a Hugging Face cache snapshot's links to blobs
  named by the sha256 of their bytes. `"full"`: the same, with `full=True`.

The bytes are hashed as they land in the load's own buffers, in the same pass as the load;
no tensor of a file that fails is handed out. See docs/verify.md.
"""

import json
import os
from typing import Any, Dict, Iterable, List, Mapping, Optional, Union

PathLike = Union[str, "os.PathLike[str]"]


def _fspath(path: PathLike) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"expected a path, not {type(path).__name__}")
    return os.fspath(path)


class Signature:
    """An OpenSSF model-signing (OMS) signature and what it is checked against: the signer's
    PEM `public_key` (`model_signing sign key`), the PEM `certificate_chain` up to a root you
    trust (`model_signing sign certificate`: a file, or a list of files), or, for a keyless
    Sigstore bundle (`model_signing sign`, its default), the signer's `identity` (the email or
    URI of its certificate) and OIDC `issuer` (`--identity_provider`), checked offline against
    the Sigstore `trusted_root` (a `trusted_root.json`, or a client trust configuration holding
    one; by default the production one the installed `sigstore` package ships). `full=True`: a
    load of part of a file (a `tensor_filter`, `get_slice`) reads the rest of it too, to check
    the file's digest; without it such a load is refused. `allow_symlinks`: follow symbolic
    links (True) or refuse them (False) whatever the signature records; by default a file loaded
    through a link is refused where the signature records `allow_symlinks=false`, as
    model_signing refuses it (a Hugging Face cache snapshot is made of links). The signature may
    be a URL (beside remote weights)."""

    def __init__(self, path: PathLike, *, public_key: Optional[PathLike] = None,
                 certificate_chain: Union[None, PathLike, Iterable[PathLike]] = None,
                 trusted_root: Optional[PathLike] = None, identity: Optional[str] = None,
                 issuer: Optional[str] = None, full: bool = False, allow_symlinks: Optional[bool] = None):
        self.path = _fspath(path)
        keyless = identity is not None or issuer is not None or trusted_root is not None
        given = [n for n, v in (("public_key", public_key), ("certificate_chain", certificate_chain),
                                ("identity=/issuer=", True if keyless else None)) if v is not None]
        if len(given) != 1:
            raise ValueError("Signature takes one of public_key=, certificate_chain= or identity= and issuer= "
                             f"(keyless, with trusted_root=), not {' and '.join(given) or 'none'}")
        if keyless and (identity is None or issuer is None):
            raise ValueError("a keyless Signature takes both identity= (the signer's email or URI) and issuer= "
                             "(its OIDC issuer, model_signing's --identity_provider)")
        self.public_key = None if public_key is None else _fspath(public_key)
        if isinstance(certificate_chain, (str, os.PathLike)):  # one file, not its characters
            certificate_chain = [certificate_chain]
        self.certificate_chain = None if certificate_chain is None else [_fspath(p) for p in certificate_chain]
        if keyless and trusted_root is None:
            trusted_root = default_trusted_root()
        self.trusted_root = None if trusted_root is None else _fspath(trusted_root)
        self.identity = None if identity is None else str(identity)
        self.issuer = None if issuer is None else str(issuer)
        self.full = bool(full)
        self.allow_symlinks = None if allow_symlinks is None else bool(allow_symlinks)

    def _spec(self) -> Dict[str, Any]:
        spec: Dict[str, Any] = {"signature": self.path, "full": self.full}
        for key in ("public_key", "certificate_chain", "trusted_root", "identity", "issuer", "allow_symlinks"):
            if getattr(self, key) is not None:
                spec[key] = getattr(self, key)
        return spec

    def __repr__(self) -> str:
        return f"Signature({self.path!r})"


class Digests:
    """Digests the caller trusts: `{file name: "sha256:<hex>"}` (also `blake2:`/`blake3:`; a
    bare 64-digit hex string is a sha256). Names are relative to the checkpoint's directory
    (a bare file name for a file at its top). `full`: as for `Signature`."""

    def __init__(self, digests: Mapping[str, str], *, full: bool = False):
        if not isinstance(digests, Mapping):
            raise TypeError(f"Digests takes a mapping of file name to digest, not {type(digests).__name__}")
        self.digests = {str(k): str(v) for k, v in digests.items()}
        self.full = bool(full)

    def _spec(self) -> Dict[str, Any]:
        return {"digests": self.digests, "full": self.full}

    def __repr__(self) -> str:
        return f"Digests({len(self.digests)} files)"


Verify = Union[None, bool, str, Signature, Digests]

# Where the `sigstore` package keeps the trusted roots it ships (its TUF repositories' names).
_SHIPPED_ROOTS = {False: "https%3A%2F%2Ftuf-repo-cdn.sigstore.dev", True: "https%3A%2F%2Ftuf-repo-cdn.sigstage.dev"}


def default_trusted_root(staging: bool = False) -> str:
    """The Sigstore trusted root the installed `sigstore` Python package ships (production, or
    staging), which sigstore-python verifies with offline; found without importing it. Raises
    ValueError, saying how to get one, where there is none."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("sigstore")
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "_store", _SHIPPED_ROOTS[staging], "trusted_root.json")
        if os.path.isfile(path):
            return path
    raise ValueError("no Sigstore trusted root: pass trusted_root= (a trusted_root.json, from Sigstore's TUF "
                     "repository tuf-repo-cdn.sigstore.dev), or `pip install sigstore`, which ships the production "
                     "one")


def spec(verify: Verify, paths: Iterable[str] = ()) -> Optional[str]:
    """The op's `verify` argument for a `verify=` value (None for an unverified load) of
    `paths` as the caller gave them, each checked as a whole: an index the manifest lists is
    verified (it chooses the files), and a directory (or URL prefix) without one must have
    every weights file the manifest lists in it loaded."""
    if verify is None or verify is False:
        return None
    checkpoints = [os.fspath(p) for p in paths]
    if verify is True or verify == "full":
        return json.dumps({"location": True, "full": verify == "full", "checkpoints": checkpoints})
    if isinstance(verify, (Signature, Digests)):
        return json.dumps({**verify._spec(), "checkpoints": checkpoints})
    raise TypeError("verify= takes fastsafetensors_rs.Signature(...), fastsafetensors_rs.Digests({...}), True or "
                    f"'full', not {verify!r}")


def from_config(config: Union[None, bool, str, Mapping[str, Any]]) -> Verify:
    """A `verify=` value from plain data (the vLLM plugin's extra config, the CLI):
    `{"signature": PATH, "public_key": PATH}`, `{"signature": ..., "certificate_chain": [...]}`,
    `{"signature": ..., "identity": ..., "issuer": ...}` (keyless; `"trusted_root": PATH`;
    model_signing's names `identity_provider` and `trust_config` too), `{"digests": {...}}`,
    True or "full"; each dict may add `"full": true`."""
    if config is None or isinstance(config, (bool, str)):
        return config
    if not isinstance(config, Mapping):
        raise TypeError(f"verify: expected a mapping, True or 'full', not {type(config).__name__}")
    options = dict(config)
    full = bool(options.pop("full", False))
    if "digests" in options:
        return Digests(options.pop("digests"), full=full)
    if "signature" in options:
        path = options.pop("signature")
        for theirs, ours in (("identity_provider", "issuer"), ("trust_config", "trusted_root")):
            if theirs in options:
                if ours in options:
                    raise ValueError(f"verify: give {ours!r} or {theirs!r}, not both")
                options[ours] = options.pop(theirs)
        return Signature(path, full=full, **options)
    raise ValueError(f"verify: expected 'signature' or 'digests' in {sorted(config)}")


__all__: List[str] = ["Signature", "Digests", "default_trusted_root"]
