"""Gemma's SentencePiece vocabulary from a GGUF file (`tokenizer.ggml.model` = llama), as a `tokenizers` BPE.

The file has the pieces, scores and types but no merges. The tokenizer is the one transformers builds from such a
file: BPE with byte fallback over the pieces, spaces written as "▁" by the normalizer (no prefix space), and
merges recovered from the vocabulary: every split of a piece into two pieces, best first by the piece's place in
the file (Gemma's scores do not follow its merge order; the order of the pieces does). Pieces of two or more
spaces are stored as spaces; they are spelled with "▁" here, as the normalizer spells the text they match.

A Gemma 3 file may carry no chat template (llama.cpp's conversions of the base model do not): Gemma 3's own is
used then, and `<end_of_turn>` ends an answer as the end-of-sequence token does.
"""

from __future__ import annotations

from typing import Any

SPACE = "\u2581"
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
END_OF_TURN = "<end_of_turn>"

GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""


def gemma_tokenizer_files(meta: Any) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """(the tokenizers.Tokenizer, tokenizer_config, generation_config) of a Gemma GGUF's `meta`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    stored: list[str] = meta.require("tokenizer.ggml.tokens")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or []
    pieces = [SPACE * len(t) if " " in t and not t.strip() else t for t in stored]
    vocab = {piece: i for i, piece in enumerate(pieces)}

    def token(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}_token_id")
        return pieces[int(idx)] if idx is not None else None

    unk = token("unknown") or "<unk>"
    tok = Tokenizer(models.BPE(vocab=vocab, merges=recovered_merges(pieces, vocab), fuse_unk=True, unk_token=unk,
                               byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(pieces, types, strict=False) if ty == TOKEN_TYPE_CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(pieces, types, strict=False) if ty == TOKEN_TYPE_USER_DEFINED])
    eos = token("eos")
    tokenizer_config = {
        "bos_token": token("bos"), "eos_token": eos, "unk_token": unk, "pad_token": token("padding"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", True)),
        "chat_template": meta.get("tokenizer.chat_template") or GEMMA3_CHAT_TEMPLATE,
    }
    ends = [vocab[t] for t in (eos, END_OF_TURN) if t in vocab]
    return tok, tokenizer_config, {"eos_token_id": ends}


def recovered_merges(pieces: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces of the vocabulary, ordered as transformers orders them for Gemma:
    by the piece's place in the file, then the longer left part, then the longer right part; within a piece,
    by the parts' ids."""
    merges: list[tuple[int, int, int, str, str]] = []
    for rank, piece in enumerate(pieces):
        if vocab.get(piece) != rank:  # a later duplicate spelling: transformers keeps the last id only
            continue
        local = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
        local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        merges.extend((rank, -len(left), -len(right), left, right) for left, right in local)
    merges.sort(key=lambda m: m[:3])  # stable: the id order within a piece stays
    return [(left, right) for *_, left, right in merges]
