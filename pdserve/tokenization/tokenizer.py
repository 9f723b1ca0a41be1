"""Text <-> token ids and chat templates, from a model folder's tokenizer files."""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from pdserve.config.errors import ModelLoadError


class Tokenizer:
    def __init__(self, folder: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self.folder = folder
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{folder} has no tokenizer.json (needed to serve text)")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise ModelLoadError(f"{path} is not a valid tokenizer file ({e})") from None
        cfg = _read_json(folder / "tokenizer_config.json")
        self.chat_template: str | None = _chat_template(folder, cfg)
        self.bos_token: str | None = _token_text(cfg.get("bos_token"))
        self.eos_token: str | None = _token_text(cfg.get("eos_token"))
        self.add_bos_token = bool(cfg.get("add_bos_token", False))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        eos_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        gen_eos = _read_json(folder / "generation_config.json").get("eos_token_id")
        ids = set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
        if eos_id is not None:
            ids.add(eos_id)
        self.eos_token_id = eos_id
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(ids))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """`continue_final_message`: the text ends with the last message's content, left open (no end of turn),
        so generation continues it: a partial assistant answer resumed, or words put in the model's mouth."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; use the completions API instead")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        text = self._compiled_template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )
        if continue_final_message:
            text = _cut_after_final_message(text, messages)
        # The template already wrote any BOS it wants, so no special tokens are added (as in HF).
        return self.encode(text, add_special_tokens=False) if tokenize else text

    @cached_property
    def _compiled_template(self) -> Any:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ValueError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def _token_text(token: Any) -> str | None:
    # tokenizer_config.json writes special tokens either as a string or as an AddedToken dict.
    if isinstance(token, dict):
        return token.get("content")
    return token


def _chat_template(folder: Path, cfg: dict[str, Any]) -> str | None:
    jinja = folder / "chat_template.jinja"  # transformers v5 writes the template to its own file
    if jinja.is_file():
        return jinja.read_text()
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template


def _cut_after_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    """The rendered text up to the end of the last message's content (as transformers does: some templates strip
    a message's whitespace, so the stripped content is looked for next)."""
    final = messages[-1].get("content") if messages else None
    if isinstance(final, list):
        final = "".join(p.get("text", "") for p in final if isinstance(p, dict))
    if not isinstance(final, str) or not final.strip():
        raise ValueError("continue_final_message needs a last message with text content to continue")
    for needle in (final, final.strip()):
        at = text.rfind(needle)
        if at >= 0:
            return text[: at + len(needle)]
    raise ValueError("continue_final_message: the chat template does not write the last message's content as given")
