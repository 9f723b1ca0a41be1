"""What llguidance's JSON grammar cannot say, applied on top of its token masks.

1. Numbers are bounded: a JSON number with a fraction or exponent has at most 17 significant digits (what a
   float64 holds) and at most 17 zeros between its point and its first significant digit, an integer at most
   19 digits (int64's), an exponent at most 3 digits (float64's 308). llguidance's number is `[0-9]+` without
   end, and its `minimum`/`maximum` bound the value, not the digits: a small model asked for a float wrote digits
   until max_tokens.
2. Tool calls in one answer are distinct: a token after which a call can only end as an earlier call did (same
   name, same arguments: JSON is compact and in schema order, so the same text) is refused, whether it writes
   the closing brace or leaves the grammar nothing else (the last string of a closed object).

A sequence's `JsonGuard` follows its output bytes with a small lexer (strings, escapes, number parts); the mask
for a lexer state is computed once per process (only the 151 of SmolLM2's 49,152 tokens with a digit or a
point, and with e/E after a long integer, can break a bound) and ANDed into the grammar's. Where the two leave
nothing (a schema's `minimum` that needs 20 digits), the grammar's mask stands alone: the guard never blocks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from pdserve.structured import tool_call_grammar as tool_grammar

MAX_SIGNIFICANT_DIGITS = 17  # float64: 17 significant digits round-trip any value
MAX_INTEGER_DIGITS = 19  # int64 holds every 18-digit integer and most 19-digit ones
MAX_EXPONENT_DIGITS = 3  # float64's exponents end at 308

CALL_START, CALL_END = tool_grammar.START.encode(), tool_grammar.END.encode()  # the blocks the grammar writes

# Lexer phases outside strings
OUTSIDE, INTEGER, FRACTION, EXPONENT_MARK, EXPONENT_SIGN, EXPONENT = range(6)
_DIGITS = frozenset(b"0123456789")

# (in_string, escaped, phase, integer_digits, significant, leading_zeros, exponent_digits)
State = tuple[bool, bool, int, int, int, int, int]
START: State = (False, False, OUTSIDE, 0, 0, 0, 0)


def advance(state: State, data: bytes) -> State | None:
    """The lexer state after `data`, or None where `data` breaks a bound."""
    in_string, escaped, phase, whole, significant, zeros, exponent = state
    for ch in data:
        if in_string:
            if escaped:
                escaped = False
            elif ch == 0x5C:  # backslash
                escaped = True
            elif ch == 0x22:  # quote
                in_string = False
            continue
        if phase in (INTEGER, FRACTION) and ch in _DIGITS:
            if phase == INTEGER:
                whole += 1
            if significant or ch != 0x30:
                significant += 1
            elif phase == FRACTION:
                zeros += 1
            if (whole > MAX_INTEGER_DIGITS or (phase == FRACTION and significant > MAX_SIGNIFICANT_DIGITS)
                    or zeros > MAX_SIGNIFICANT_DIGITS):
                return None
            continue
        if phase == INTEGER and ch in b".eE":
            if significant > MAX_SIGNIFICANT_DIGITS:
                return None
            phase = FRACTION if ch == 0x2E else EXPONENT_MARK
            continue
        if phase == FRACTION and ch in b"eE":
            phase = EXPONENT_MARK
            continue
        if phase == EXPONENT_MARK and ch in b"+-":
            phase = EXPONENT_SIGN
            continue
        if phase in (EXPONENT_MARK, EXPONENT_SIGN, EXPONENT) and ch in _DIGITS:
            phase, exponent = EXPONENT, exponent + 1
            if exponent > MAX_EXPONENT_DIGITS:
                return None
            continue
        # Anything else ends a number; outside one, a quote opens a string and a digit or minus starts a number
        phase, whole, significant, zeros, exponent = OUTSIDE, 0, 0, 0, 0
        if ch == 0x22:
            in_string = True
        elif ch == 0x2D:
            phase = INTEGER
        elif ch in _DIGITS:
            phase, whole, significant = INTEGER, 1, int(ch != 0x30)
    return (in_string, escaped, phase, whole, significant, zeros, exponent)


class TokenTexts:
    """The bytes of every token of one vocabulary (special tokens as none: they write no JSON), and the masks
    of the number bounds per lexer state, as the grammar's mask words (bit j of word w: token 32 w + j)."""

    def __init__(self, token_bytes: list[bytes], words: int) -> None:
        self.token_bytes, self.words = token_bytes, words
        self.numeric = [i for i, b in enumerate(token_bytes) if re.search(rb"[0-9.]", b)]
        self.exponent_letters = [i for i, b in enumerate(token_bytes) if re.search(rb"[eE]", b)]
        self.by_first_byte: dict[int, list[int]] = {}
        for i, b in enumerate(token_bytes):
            if b:
                self.by_first_byte.setdefault(b[0], []).append(i)
        self._masks: dict[State, np.ndarray] = {}

    @classmethod
    def of(cls, tokenizer: object, vocab_size: int) -> TokenTexts:
        """From llguidance's LLTokenizer (`decode_bytes`, `is_special_token`)."""
        n = tokenizer.vocab_size
        texts = [b"" if tokenizer.is_special_token(i) else tokenizer.decode_bytes([i]) for i in range(n)]
        return cls(texts + [b""] * max(0, vocab_size - n), (vocab_size + 31) // 32)

    def number_mask(self, state: State) -> np.ndarray | None:
        """Words allowing every token that keeps the numbers within bounds from `state`; None: all do."""
        if state not in self._masks:
            candidates = self.numeric
            if state[2] == INTEGER and state[4] >= MAX_SIGNIFICANT_DIGITS:  # an exponent would make it a float
                candidates = candidates + self.exponent_letters
            refused = [i for i in candidates if advance(state, self.token_bytes[i]) is None]
            self._masks[state] = self.words_without(refused) if refused else None
        return self._masks[state]

    def words_without(self, refused: list[int]) -> np.ndarray:
        allowed = np.ones(self.words * 32, dtype=bool)
        allowed[refused] = False
        return np.packbits(allowed, bitorder="little").view(np.int32)


@dataclass
class JsonGuard:
    """One sequence's bounds. `calls_only`: the output is tool-call blocks (and, under tool_choice auto, text
    before them): numbers are lexed inside the blocks only; `distinct_calls`: a call may not repeat one."""

    texts: TokenTexts
    calls_only: bool = False
    distinct_calls: bool = False
    state: State = START
    output: bytearray = field(default_factory=bytearray)  # tool calls: the answer so far
    body_start: int | None = None  # where the open call's body starts in `output`
    calls: list[bytes] = field(default_factory=list)  # bodies of the finished calls

    def __post_init__(self) -> None:
        if not self.calls_only:
            self.body_start = 0

    def copy(self) -> JsonGuard:
        return JsonGuard(self.texts, self.calls_only, self.distinct_calls, self.state, bytearray(self.output),
                         self.body_start, list(self.calls))

    def consume(self, token_id: int) -> None:
        data = self.texts.token_bytes[token_id] if token_id < len(self.texts.token_bytes) else b""
        if not self.calls_only:  # the whole answer is JSON: only the lexer's state matters
            self.state = advance(self.state, data) or START
            return
        before = len(self.output)
        self.output += data
        self._follow_calls(before)

    def _follow_calls(self, before: int) -> None:
        scan_from = max(0, before - len(CALL_END))
        if self.body_start is None:
            at = self.output.find(CALL_START, scan_from)
            if at < 0:
                return
            self.body_start, self.state, scan_from = at + len(CALL_START), START, at + len(CALL_START)
        end = self.output.find(CALL_END, max(scan_from, self.body_start))
        body_end = len(self.output) if end < 0 else end
        self.state = advance(self.state, bytes(self.output[max(before, self.body_start):body_end])) or START
        if end >= 0:
            self.calls.append(bytes(self.output[self.body_start:end]))
            self.body_start = None
            self._follow_calls(end + len(CALL_END))

    def mask(self, matcher: object) -> np.ndarray | None:
        """The allowed-token words for the next token (None: no restriction); `matcher`: the sequence's
        llguidance matcher, where it is now."""
        if self.body_start is None:
            return None
        words = self.texts.number_mask(self.state)
        repeats = self._repeating_tokens(matcher)
        if repeats:
            extra = self.texts.words_without(repeats)
            words = extra if words is None else words & extra
        return words

    def _repeating_tokens(self, matcher: object) -> list[int]:
        """Tokens after which the open call can only end as an earlier one did: those that write the rest of
        its arguments, and those after which the grammar forces that rest (a closed object's last string)."""
        if not self.distinct_calls or not self.calls:
            return []
        body = bytes(self.output[self.body_start:])
        refused: list[int] = []
        for earlier in self.calls:
            closed = earlier[:-1]  # through the arguments' closing brace; the call's own brace is forced
            if len(body) >= len(closed) or not closed.startswith(body):
                continue
            rest = closed[len(body):]
            for i in self.texts.by_first_byte.get(rest[0], []):
                data = self.texts.token_bytes[i]
                if data.startswith(rest) or (rest.startswith(data) and _forces(matcher, i, rest[len(data):])):
                    refused.append(i)
        return refused


def _forces(matcher: object, token_id: int, then: bytes) -> bool:
    """Whether, after `token_id`, the grammar leaves no choice but to write `then`."""
    probe = matcher.deep_copy()
    return probe.consume_token(token_id) and probe.compute_ff_bytes().startswith(then)
