"""Structured outputs: grammars that constrain sampling (JSON schema, regex, choice, Lark/GBNF). The
spec (spec.py) is torch-free and travels in SamplingParams; the matchers (matcher.py) run in the
worker beside the sampler. Tool calling (pdserve/tool_calling) builds its forced calls on them."""
