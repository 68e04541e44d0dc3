"""Print the CMAKE_ARGS that build llama-cpp-python for the CPU this runs on (the Makefile uses it).

Why not llama.cpp's default native build (``GGML_NATIVE=ON``, ``-march=native``): on the machine
described in ../shared/notes/llama-cpp-python-0.3.36.md (a VM reporting AVX-512 and AMX) the native
build segfaulted in ``llama_decode`` on the AMX path, while a portable build with the same ISA
flags minus AMX worked and batched as well. So the build is portable (``GGML_NATIVE=OFF``) with
exactly the instruction sets this CPU's ``/proc/cpuinfo`` reports switched on, AMX never, and the
rest explicitly off (a wheel built on a richer machine would die of SIGILL here; one built here is
right for this CPU and any CPU that has at least these flags). At run time the engine still
probes llama.cpp's extra buffer types in a child process before using them (engine/llamacpp.py).

Overrides: ``PEERINFER_LLAMA_CMAKE_ARGS`` is printed as it is (e.g. ``-DGGML_NATIVE=ON`` for a
native build, or ``-DGGML_CUDA=on``); ``PEERINFER_LLAMA_NATIVE=1`` prints ``-DGGML_NATIVE=ON``.
On a CPU that is not x86 (no AVX flags: ARM, Apple silicon) it prints ``-DGGML_NATIVE=ON``,
llama.cpp's own choice there.

Usage: python scripts/llama_cmake_args.py [--cpuinfo FILE]
"""

from __future__ import annotations

import os
import sys

#: (cpuinfo flag, llama.cpp's CMake option), in llama.cpp's order.
X86_FLAGS = (
    ("avx", "GGML_AVX"),
    ("avx2", "GGML_AVX2"),
    ("avx_vnni", "GGML_AVX_VNNI"),
    ("fma", "GGML_FMA"),
    ("f16c", "GGML_F16C"),
    ("bmi2", "GGML_BMI2"),
    ("avx512f", "GGML_AVX512"),
    ("avx512vbmi", "GGML_AVX512_VBMI"),
    ("avx512_vnni", "GGML_AVX512_VNNI"),
    ("avx512_bf16", "GGML_AVX512_BF16"),
)
#: Never switched on: the AMX path is what crashed the native build.
NEVER = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


def cmake_args(cpu_flags: set[str]) -> str:
    """The CMAKE_ARGS for a CPU with these /proc/cpuinfo flags."""
    if "avx" not in cpu_flags and "avx2" not in cpu_flags:
        return "-DGGML_NATIVE=ON"
    parts = ["-DGGML_NATIVE=OFF"]
    for flag, option in X86_FLAGS:
        parts.append(f"-D{option}={'ON' if flag in cpu_flags else 'OFF'}")
    parts.extend(f"-D{option}=OFF" for option in NEVER)
    return " ".join(parts)


def read_flags(path: str = "/proc/cpuinfo") -> set[str]:
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def main(argv: list[str]) -> int:
    override = os.environ.get("PEERINFER_LLAMA_CMAKE_ARGS")
    if override is not None:
        print(override)
        return 0
    if os.environ.get("PEERINFER_LLAMA_NATIVE") == "1":
        print("-DGGML_NATIVE=ON")
        return 0
    path = argv[argv.index("--cpuinfo") + 1] if "--cpuinfo" in argv else "/proc/cpuinfo"
    print(cmake_args(read_flags(path)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
