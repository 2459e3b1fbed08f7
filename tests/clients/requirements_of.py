"""Prints the requirements of an installed distribution, one per line, for `pip install -r`.

    python requirements_of.py vllm --override certifi==2026.10.18 > reqs.txt

Markers are evaluated for this interpreter (extras are left out); `--override NAME...`
replaces a requirement of the same project name (the registry may not serve the newest
version a wheel asks for), `--drop NAME` leaves one out.
"""

import argparse
import sys
from importlib.metadata import requires

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("dist")
    parser.add_argument("--override", action="append", default=[])
    parser.add_argument("--drop", action="append", default=[])
    args = parser.parse_args()
    overrides = {canonicalize_name(Requirement(o).name): o for o in args.override}
    dropped = {canonicalize_name(d) for d in args.drop}
    for line in requires(args.dist) or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name in dropped:
            continue
        if name in overrides:
            print(overrides.pop(name))
            continue
        req.marker = None
        print(req)
    for unused in overrides.values():
        print(f"override {unused!r} matches no requirement of {args.dist}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
