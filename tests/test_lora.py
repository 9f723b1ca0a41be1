"""LoRA adapters (issue 40): PEFT adapters made with `peft` on the embedded model, served batched by
pdserve's runner, against transformers + peft; and the adapters pdserve refuses, each with why."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pdserve.lora.adapter import AdapterError, load_adapter
from pdserve.model.forward_batch import SequenceChunk
from pdserve.model.load import load_config

# (target modules, rank, rslora): every projection, alone and together, and both scalings. No adapter is named
# like a module path part ("mlp"): peft would leave that module's weights out of the others' saved files.
ADAPTERS = {"qv": (["q_proj", "v_proj"], 8, False),
            "every": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 16, False),
            "outputs": (["o_proj", "down_proj"], 4, False),
            "ffn": (["gate_proj", "up_proj"], 8, True)}
PROMPTS = ["The lighthouse keeper wrote down the ships that passed,", "def fibonacci(n):\n    ",
           "Three facts about the moon:", "Paris is the capital of", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def peft_model(hf_gguf_model, tmp_path_factory: pytest.TempPathFactory):
    """(the peft model holding every adapter, {name: its PEFT folder}); B random and non-zero."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("lora")
    model = None
    for i, (name, (modules, rank, rslora)) in enumerate(ADAPTERS.items()):
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=modules, use_rslora=rslora,
                            init_lora_weights=False)
        if model is None:
            model = get_peft_model(copy.deepcopy(hf_gguf_model), config, adapter_name=name)
        else:
            model.add_adapter(name, config)
        generator = torch.Generator().manual_seed(i)
        for key, p in model.named_parameters():
            if f"lora_B.{name}." in key:  # an update about 5% of the base projection's output
                p.data.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    model.save_pretrained(root, selected_adapters=list(ADAPTERS))
    return model.eval(), {name: root / name for name in ADAPTERS}  # peft saves a named adapter in its folder


@pytest.fixture(scope="module")
def lora_runner(peft_model):
    from pdserve.worker.model_runner import ModelRunner

    runner = ModelRunner(None, dtype="float32", device="cpu", quantization="none", block_size=16, max_loras=4,
                         max_lora_rank=16)
    runner.allocate_kv_cache(64)
    for name, folder in peft_model[1].items():
        runner.add_adapter(name, folder)
    return runner


def _oracle(model, name: str | None, ids: list[int]) -> torch.Tensor:
    """transformers + peft: the logits after every token, under adapter `name` (None: the base)."""
    with torch.no_grad():
        if name is None:
            with model.disable_adapter():
                return model(torch.tensor([ids])).logits[0].float()
        model.set_adapter(name)
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.e2e
def test_four_adapters_and_the_base_in_one_batch_each_equal_their_peft_oracle(peft_model, lora_runner,
                                                                             embedded_tokenizer) -> None:
    model, _ = peft_model
    runner = lora_runner
    names = [*ADAPTERS, None]  # one prompt each: four adapters and the base share every step
    prompts = [embedded_tokenizer.encode(p) for p in PROMPTS]
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(prompts))]
    seqs = [list(p) for p in prompts]
    slots = runner.lora_slots_for(names)
    assert sorted(s for s in slots if s >= 0) == [0, 1, 2, 3] and slots[-1] == -1
    # the prompts in two chunks (a cached prefix then the rest), then four decode steps, greedy
    cut = [len(p) // 2 for p in prompts]
    runner.logits([SequenceChunk(p[:c], 0, t, s) for p, c, t, s in zip(prompts, cut, tables, slots, strict=True)])
    chunks = [SequenceChunk(p[c:], c, t, s) for p, c, t, s in zip(prompts, cut, tables, slots, strict=True)]
    steps = []
    for _ in range(5):
        logits = runner.logits(chunks)
        steps.append(logits)
        nxt = logits.argmax(-1).tolist()
        chunks = [SequenceChunk([tok], len(seq), t, s) for tok, seq, t, s in zip(nxt, seqs, tables, slots, strict=True)]
        for seq, tok in zip(seqs, nxt, strict=True):
            seq.append(tok)
    for i, name in enumerate(names):
        want = _oracle(model, name, seqs[i])
        got = torch.stack([s[i] for s in steps])  # the logits after the prompt and after each decoded token
        ref = want[len(prompts[i]) - 1:len(prompts[i]) - 1 + len(steps)]
        assert torch.allclose(got, ref, atol=2e-3, rtol=0), f"{name}: max diff {(got - ref).abs().max():.2e}"
        if name is not None:  # the adapter changes the answer's logits: the test could fail
            base = _oracle(model, None, seqs[i])[len(prompts[i]) - 1:len(prompts[i]) - 1 + len(steps)]
            assert (ref - base).abs().max() > 0.1, f"{name} barely changes the logits"


@pytest.mark.e2e
def test_adapters_over_a_packed_quantized_base_add_what_peft_adds(peft_model, lora_runner, embedded_tokenizer) -> None:
    """The embedded Q4_1 file served packed (its default), adapters in fp32 over it: each adapter changes the
    packed model's logits, and leaves them as close to the exact model-with-adapter as the packed base is to the
    exact base."""
    from pdserve.worker.model_runner import ModelRunner

    packed = ModelRunner(None, dtype="float32", device="cpu", block_size=16, max_loras=4, max_lora_rank=16)
    assert packed.quantization == "gguf"
    packed.allocate_kv_cache(64)
    for name, folder in peft_model[1].items():
        packed.add_adapter(name, folder)
    table = list(range(8))

    def logits(runner, name: str | None) -> torch.Tensor:  # noqa: ANN001  (every prompt's last logits)
        slot = runner.lora_slots_for([name])[0]
        return torch.stack([runner.logits([SequenceChunk(embedded_tokenizer.encode(p), 0, table, slot)])[0]
                            for p in PROMPTS])

    exact_base, packed_base = logits(lora_runner, None), logits(packed, None)
    base_error = float((packed_base - exact_base).norm())
    for name in ADAPTERS:
        exact, ours = logits(lora_runner, name), logits(packed, name)
        exact_delta, packed_delta = (exact - exact_base).flatten(), (ours - packed_base).flatten()
        assert exact_delta.abs().max() > 0.1 and packed_delta.abs().max() > 0.1  # the adapter acts on both
        # int8 activations move single logits by about an adapter's own update (the two do not line up logit by
        # logit), so what must hold is that with the adapter the packed model stays as close to the exact one as
        # without it
        error = float((ours - exact).norm())
        print(f"{name}: error {error:.2f} (the base's {base_error:.2f})")
        assert error <= 1.5 * base_error, (name, error, base_error)


@pytest.mark.e2e
def test_more_adapters_than_slots_rotate_through_them(peft_model, lora_runner, embedded_tokenizer) -> None:
    """Five adapters on four slots: each step places the ones it needs, least recently used out."""
    model, folders = peft_model
    runner = lora_runner
    runner.add_adapter("qv-again", folders["qv"])
    prompt = embedded_tokenizer.encode(PROMPTS[0])
    for name in ["qv-again", "every", "qv", "outputs", "ffn", "qv-again"]:
        slot = runner.lora_slots_for([name])[0]
        got = runner.logits([SequenceChunk(prompt, 0, list(range(8)), slot)])[0]
        want = _oracle(model, name.removesuffix("-again"), prompt)[-1]
        assert torch.allclose(got, want, atol=2e-3, rtol=0), name
    assert "qv-again" in runner.lora_slots.names and len(set(runner.lora_slots.names)) == 4
    runner.remove_adapter("qv-again")
    with pytest.raises(AdapterError, match="'qv-again' is not loaded"):
        runner.lora_slots_for(["qv-again"])


def _peft_greedy(model, name: str | None, ids: list[int], n: int) -> list[int]:
    seq = list(ids)
    for _ in range(n):
        seq.append(int(_oracle(model, name, seq)[-1].argmax()))
    return seq[len(ids):]


@pytest.mark.e2e
def test_the_engine_serves_adapters_in_rotation_and_keys_its_prefix_cache_by_adapter(peft_model,
                                                                                   embedded_tokenizer) -> None:
    """Through LLM (engine, scheduler, worker): four adapters and the base on two slots, each answer equal to
    transformers + peft greedy; a prompt cached under one adapter is not reused for another or the base."""
    from pdserve import LLM, LoRARequest, SamplingParams

    model, folders = peft_model
    names = [*ADAPTERS, None]
    prompts = [embedded_tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=6)
    with LLM(dtype="float32", quantization="none", enable_lora=True, max_loras=2, max_lora_rank=16, block_size=16,
             lora_modules=[f"qv={folders['qv']}"], num_gpu_blocks_override=256, max_model_len=1024) as llm:
        requests = [None if n is None else LoRARequest(n, i + 1, str(folders[n])) for i, n in enumerate(names)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                            lora_request=requests)
        for out, name, ids in zip(outs, names, prompts, strict=True):
            assert out.outputs[0].token_ids == _peft_greedy(model, name, ids, 6), name
        llm.engine.add_request("gone-0", prompts[0], params, [], lora_name="gone")  # unloaded since the API checked
        (out,) = llm.engine.get_outputs(timeout=30)
        assert out.request_id == "gone-0" and "'gone' is not loaded" in out.error  # this request alone fails
        # the same long prompt under "every", then "qv", then the base, then "every" again: only the last hits
        long = embedded_tokenizer.encode(" ".join(PROMPTS) * 2)
        cached = []
        for name in ["every", "qv", None, "every"]:
            request = None if name is None else LoRARequest(name, 1, str(folders[name]))
            out = llm.generate({"prompt_token_ids": long}, params, use_tqdm=False, lora_request=request)[0]
            cached.append(out.num_cached_tokens)
        assert cached[:3] == [0, 0, 0] and cached[3] >= 16 * (len(long) // 16 - 1), cached
        llm.check_idle()


@pytest.mark.e2e
def test_serve_answers_adapters_by_model_name_and_loads_them_at_run_time(peft_model, embedded_tokenizer,
                                                                        embedded_folder: Path, tmp_path: Path) -> None:
    import httpx
    import openai

    from tests.servers import Server, stop_all

    model, folders = peft_model
    every = json.dumps({"name": "every", "path": str(folders["every"])})  # vLLM's JSON form
    server = Server(tmp_path / "serve", "--dtype", "float32", "--quantization", "none", "--enable-lora",
                    "--max-loras", "2",
                    "--lora-modules", f"qv={folders['qv']}", every,
                    "--enable-lora-runtime-loading", "--num-gpu-blocks-override", "256", "--max-model-len", "1024")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        cards = {m.id: m for m in client.models.list().data}
        base = next(m for m in cards if m not in ADAPTERS)
        assert set(cards) == {base, "qv", "every"} and cards["qv"].model_extra["parent"] == base
        prompt = embedded_tokenizer.encode(PROMPTS[2])

        def answer(name: str) -> str:
            out = client.completions.create(model=name, prompt=prompt, max_tokens=6, temperature=0)
            assert out.model == name
            return out.choices[0].text

        for name in ["qv", "every", base]:
            assert answer(name) == embedded_tokenizer.decode(_peft_greedy(model, None if name == base else name,
                                                                          prompt, 6)), name
        with pytest.raises(openai.NotFoundError, match="'ffn' does not exist"):
            answer("ffn")

        def post(path: str, body: dict) -> httpx.Response:
            return httpx.post(f"{server.url}/v1/{path}", json=body, timeout=120)

        r = post("load_lora_adapter", {"lora_name": "ffn", "lora_path": str(folders["ffn"])})
        assert r.status_code == 200 and "added" in r.text
        assert answer("ffn") == embedded_tokenizer.decode(_peft_greedy(model, "ffn", prompt, 6))
        h = load_config(embedded_folder).hidden_size
        bad = _adapter(tmp_path / "bad", _pair(0, "q_proj", 32, h, h))
        r = post("load_lora_adapter", {"lora_name": "bad", "lora_path": str(bad)})
        assert r.status_code == 400 and "rank 32 is above --max-lora-rank 16" in r.json()["error"]["message"]
        assert post("unload_lora_adapter", {"lora_name": "ffn"}).status_code == 200
        with pytest.raises(openai.NotFoundError):
            answer("ffn")
        assert post("unload_lora_adapter", {"lora_name": "ffn"}).status_code == 404
    finally:
        stop_all([server])


@pytest.mark.e2e
def test_a_pd_pair_serves_adapters_like_peft_and_keeps_their_prefixes_apart(peft_model, embedded_tokenizer,
                                                                          tmp_path: Path) -> None:
    """launch 1P1D, every request through the pair: P computes the prompt under the adapter, D decodes under it."""
    import signal

    import openai

    from tests.servers import segments, wait_for
    from tests.test_launch import Launch

    model, folders = peft_model
    before = segments()
    launch = Launch(tmp_path, "--prefill", "1", "--decode", "1", "--routers", "1", "--pd-policy", "always",
                    "--ttft-slo-ms", "0", "--tpot-slo-ms", "0", "--dtype", "float32", "--quantization", "none",
                    "--max-model-len", "1024",
                    "--num-gpu-blocks-override", "256", "--enable-lora", "--max-loras", "2",
                    "--lora-modules", f"qv={folders['qv']}", f"every={folders['every']}")
    try:
        client = openai.OpenAI(base_url=f"{launch.url}/v1", api_key="x", max_retries=0)
        prompt = embedded_tokenizer.encode(PROMPTS[4])
        for name in ["every", "qv", None]:
            out = client.completions.create(model=name or "SmolLM2-135M-Instruct", prompt=prompt, max_tokens=6,
                                            temperature=0)
            assert out.choices[0].text == embedded_tokenizer.decode(_peft_greedy(model, name, prompt, 6)), name
        long = embedded_tokenizer.encode(" ".join(PROMPTS) * 3)
        cached = []
        for name in ["every", "every", "qv", None]:
            out = client.completions.create(model=name or "SmolLM2-135M-Instruct", prompt=long, max_tokens=2,
                                            temperature=0)
            cached.append(out.usage.prompt_tokens_details.cached_tokens)
        assert cached[0] == 0 and cached[1] >= 64 and cached[2:] == [0, 0], cached
    finally:
        if launch.proc.poll() is None:
            launch.proc.send_signal(signal.SIGINT)
            launch.proc.wait(60)
        wait_for(lambda: segments() <= before, 20, "the deployment left shared-memory segments")


def _adapter(folder: Path, tensors: dict[str, torch.Tensor], **settings) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                                                            **settings}))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def _pair(layer: int, module: str, rank: int, fan_in: int, fan_out: int) -> dict[str, torch.Tensor]:
    kind = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    key = f"base_model.model.model.layers.{layer}.{kind}.{module}"
    return {f"{key}.lora_A.weight": torch.ones(rank, fan_in), f"{key}.lora_B.weight": torch.ones(fan_out, rank)}


@pytest.mark.parametrize("case,match", [
    ("rank", "rank 32 is above --max-lora-rank 16"),
    ("module", "target module 'dense' is not one the model has"),
    ("shape", r"do not fit the base model's 576 -> 576 projection"),
    ("layer", "layer 99 is beyond the base model's 30 layers"),
    ("dora", "use_dora=True is not served"),
    ("missing", "adapter_config.json not found"),
])
def test_an_adapter_that_does_not_fit_is_refused_naming_why(case: str, match: str, embedded_folder: Path,
                                                            tmp_path: Path) -> None:
    config = load_config(embedded_folder)
    h = config.hidden_size
    folder = tmp_path / case
    if case == "rank":
        _adapter(folder, _pair(0, "q_proj", 32, h, h))
    elif case == "module":
        _adapter(folder, _pair(0, "dense", 8, h, h))
    elif case == "shape":
        _adapter(folder, _pair(0, "q_proj", 8, 2 * h, h))  # trained on a wider model
    elif case == "layer":
        _adapter(folder, _pair(99, "q_proj", 8, h, h))
    elif case == "dora":
        _adapter(folder, _pair(0, "q_proj", 8, h, h), use_dora=True)
    else:
        folder.mkdir()
    with pytest.raises(AdapterError, match=match):
        load_adapter(case, folder, config, max_rank=16)


def test_an_adapter_on_a_normed_block_output_is_refused(embedded_folder: Path, tmp_path: Path) -> None:
    """Gemma 3 norms the attention's and the MLP's outputs before the residual: an o_proj or down_proj adapter
    would be added past that norm, so it is refused, naming the module; q/k/v and gate/up adapters load."""
    import dataclasses

    config = dataclasses.replace(load_config(embedded_folder), sandwich_norms=True, model_type="gemma3_text")
    h, inter = config.hidden_size, config.intermediate_size
    with pytest.raises(AdapterError, match="o_proj of a gemma3_text model is not served"):
        load_adapter("o", _adapter(tmp_path / "o", _pair(0, "o_proj", 8, config.q_size, h)), config, max_rank=16)
    with pytest.raises(AdapterError, match="down_proj of a gemma3_text model is not served"):
        load_adapter("down", _adapter(tmp_path / "down", _pair(0, "down_proj", 8, inter, h)), config, max_rank=16)
    assert load_adapter("q", _adapter(tmp_path / "q", _pair(0, "q_proj", 8, h, config.q_size)), config, 16).rank == 8


@pytest.mark.parametrize("mask_rows", [0, 10**6])  # by group (long runs) and by mask
def test_both_ways_of_a_step_add_each_tokens_own_adapter(mask_rows: int, embedded_folder: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.lora.slots import LoRABatch, LoRASlots

    config = load_config(embedded_folder)
    h, kv = config.hidden_size, config.kv_size
    generator = torch.Generator().manual_seed(0)

    def random_pair(layer: int, module: str, rank: int, fan_in: int, fan_out: int) -> dict[str, torch.Tensor]:
        return {k: torch.randn(v.shape, generator=generator) for k, v in _pair(layer, module, rank, fan_in,
                                                                                fan_out).items()}

    adapters = [load_adapter("a", _adapter(tmp_path / "a", {**random_pair(3, "k_proj", 8, h, kv),
                                                            **random_pair(3, "v_proj", 4, h, kv)}), config, 16),
                load_adapter("b", _adapter(tmp_path / "b", random_pair(3, "v_proj", 16, h, kv)), config, 16)]
    slots = LoRASlots(config, 2, 16, torch.float32, torch.device("cpu"))
    placed = slots.place(adapters)
    monkeypatch.setattr(LoRABatch, "MASK_ROWS", mask_rows)
    lengths, owners = [100, 150, 50], [placed["a"], -1, placed["b"]]
    batch = LoRABatch.build(slots, owners, lengths, torch.device("cpu"))
    assert (batch.groups is None) == (mask_rows > 0)
    x = torch.randn(300, h, generator=generator)
    out = torch.zeros(300, config.q_size + 2 * kv)
    batch.add(out, x, 3, "qkv")
    batch.add(out, x, 2, "qkv")  # a layer neither adapter touches adds nothing
    want = torch.zeros_like(out)
    for adapter, rows in ((adapters[0], slice(0, 100)), (adapters[1], slice(250, 300))):
        for module, cols in (("k_proj", slice(h, h + kv)), ("v_proj", slice(h + kv, h + 2 * kv))):
            if (pair := adapter.weights.get((3, module))) is not None:
                want[rows, cols] = x[rows] @ pair[0].t() @ pair[1].t()
    assert torch.allclose(out, want, atol=1e-3, rtol=1e-4)
    assert out[100:250].abs().max() == 0 and out[:, :h].abs().max() == 0  # the base rows; q untouched


def test_alpha_and_rslora_scale_the_update_as_peft_does(embedded_folder: Path, tmp_path: Path) -> None:
    config = load_config(embedded_folder)
    h = config.hidden_size
    plain = load_adapter("plain", _adapter(tmp_path / "plain", _pair(0, "q_proj", 4, h, h), r=4, lora_alpha=8),
                         config, 16)
    rs = load_adapter("rs", _adapter(tmp_path / "rs", _pair(0, "q_proj", 4, h, h), r=4, lora_alpha=8,
                                     use_rslora=True), config, 16)
    assert plain.weights[(0, "q_proj")][1][0, 0] == pytest.approx(8 / 4)
    assert rs.weights[(0, "q_proj")][1][0, 0] == pytest.approx(8 / 2)
    assert plain.rank == 4 and plain.modules == {"q_proj"}
