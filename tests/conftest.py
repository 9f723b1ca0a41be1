"""Shared fixtures. The Hugging Face oracle for the embedded model loads once per test session (~30 s)."""

from __future__ import annotations

from tests.loopback_only import enter_loopback_namespace
from tests.private_shm import enter_private_shm

NETWORK = enter_loopback_namespace()  # first, before anything starts a thread: only lo from here on
SHM = enter_private_shm()  # an xdist worker's own /dev/shm, so leak checks see only its own servers

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)


def pytest_report_header() -> str:
    return f"network: {NETWORK}; /dev/shm: {SHM}"


@pytest.fixture(scope="session")
def embedded_folder() -> Path:
    from pdserve.loader import resolve_model_folder

    return resolve_model_folder(None)


@pytest.fixture(scope="session")
def embedded_tokenizer(embedded_folder: Path):
    from pdserve.tokenization.tokenizer import Tokenizer

    return Tokenizer(embedded_folder)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The flags that serve a tiny random llama (2 layers, the embedded model's tokenizer and chat template:
    tests/tiny_models.py) in fp32 as "tiny": for tests of protocol, lifecycle, routing and failover, which any
    model shows. It starts and steps in a fraction of the embedded model's time, and in fp32 two routes to the same
    answer (a prefill here, a decode there, a stream resumed elsewhere) agree but for the last bits."""
    from tests.tiny_models import make_tiny_servable

    folder = tmp_path_factory.mktemp("tiny-servable") / "model"
    make_tiny_servable(folder, max_position_embeddings=4096)
    return ["--model", str(folder), "--served-model-name", "tiny", "--dtype", "float32"]


@pytest.fixture(scope="session")
def embedded_runner():
    from pdserve.worker.model_runner import ModelRunner

    return ModelRunner(None, dtype="float32", device="cpu", quantization="none")  # the exact path the oracle checks


@pytest.fixture(scope="session")
def hf_gguf_model():
    """transformers' own model, loaded from the same GGUF file the embedded model ships."""
    from transformers import AutoModelForCausalLM

    from pdserve.loader.default_model import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_gguf_tokenizer():
    from transformers import AutoTokenizer

    from pdserve.loader.default_model import default_model_path

    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]], list[list[int]]]:
    """(a tiny random llama's folder, prompts, transformers' greedy continuations): tests/tiny_models.py."""
    from tests.tiny_models import tiny_with_answers

    return tiny_with_answers(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def ops():
    """pdserve's compiled CPU kernels (torch.ops.pdserve_kernels); a failed build fails the test."""
    from pdserve.kernels import cpu_ops

    built = cpu_ops()
    if built is None:
        pytest.fail("the compiled attention kernel did not build on this machine (python -m pdserve.kernels)")
    return built
