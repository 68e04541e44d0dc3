"""Compile peerinfer's pure core with mypyc, in place: ``make native`` (peerinfer/native.py).

Compiles every module of ``peerinfer/core`` but the wire codec and the messages (their classes
are made by decorators, which mypyc's classes cannot be) into C extensions beside the sources,
then writes ``peerinfer/native_manifest.json`` with the hash of every source the build read
(the whole core, ``types.py`` and ``errors.py``), last: a build that fails leaves no manifest,
and the sources run as they are.

Why mypyc: the core is typed strictly already (mypy), so the same source compiles with no second
language and no annotations of its own; the modules stay plain Python for every reader, every
test and every machine without a C compiler (docs/architecture.md, "The compiled core").

    python scripts/build_native.py           build (about 5 minutes, on one core)
    python scripts/build_native.py --clean   remove the extensions and the manifest
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from peerinfer import native  # noqa: E402

#: the compiled modules' package directories
PACKAGES = ("peerinfer/core",)
#: sources left as Python: their classes are made by decorators (``register``, ``quick_init``),
#: which extension classes cannot be; the package ``__init__`` files only re-export
LEFT_OUT = {
    "peerinfer/core/messages.py",
    "peerinfer/core/wire.py",
    "peerinfer/core/quickinit.py",
}
#: what the core imports from outside it: the build reads these too (and inlines their
#: ``Final`` constants), so a change to them makes a build stale as well
OUTSIDE_INPUTS = ("peerinfer/types.py", "peerinfer/errors.py")
#: the shared library of every compiled module: ``peerinfer/native__mypyc*.so``
GROUP = "peerinfer.native"


def inputs() -> list[str]:
    """Every source the build reads: the core's, compiled or not, and what the core imports."""
    found = [path.relative_to(ROOT).as_posix()
             for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]
    return found + list(OUTSIDE_INPUTS)


def sources() -> list[str]:
    """The sources compiled."""
    return [name for name in inputs()
            if name.startswith(PACKAGES) and name not in LEFT_OUT
            and not name.endswith("/__init__.py")]


def extensions() -> list[Path]:
    """The extensions a build made: the group's library and one beside each compiled source."""
    return sorted(
        path for path in (ROOT / "peerinfer").rglob("*.so")
        if path.name.startswith(GROUP.rpartition(".")[2] + "__mypyc.")
        or path.with_name(path.name.partition(".")[0] + ".py").is_file()
    )


def clean() -> None:
    native.MANIFEST.unlink(missing_ok=True)
    for path in extensions():
        path.unlink()
    shutil.rmtree(ROOT / "build" / "native", ignore_errors=True)


def build() -> int:
    from mypyc.build import mypycify
    from setuptools import setup

    clean()
    names = sources()
    started = time.monotonic()
    os.chdir(ROOT)
    argv = sys.argv
    sys.argv = [argv[0], "--quiet", "build_ext", "--inplace", "--build-temp", "build/native"]
    try:
        setup(
            name="peerinfer-native",
            ext_modules=mypycify(
                names, opt_level="3", group_name=GROUP, target_dir="build/native"
            ),
            py_modules=[],
            script_args=sys.argv[1:],
        )
    finally:
        sys.argv = argv
    built = [p.relative_to(ROOT).as_posix() for p in extensions()]
    manifest = {
        "cache_tag": sys.implementation.cache_tag,
        "compiled": names,
        "sources": {name: native.source_hash(ROOT / name) for name in inputs()},
        "extensions": built,
    }
    native.MANIFEST.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print(f"compiled {len(names)} modules into {len(built)} extensions "
          f"in {time.monotonic() - started:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clean", action="store_true", help="remove what a build made")
    args = parser.parse_args(argv)
    if args.clean:
        clean()
        return 0
    return build()


if __name__ == "__main__":
    raise SystemExit(main())
