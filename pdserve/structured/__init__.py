"""Structured outputs: grammars that constrain sampling (JSON schema, regex, choice, Lark/GBNF), and
tool calls built on them. The spec (spec.py) is torch-free and travels in SamplingParams; the matcher
(matcher.py) runs in the worker beside the sampler; tools.py is the API server's tool calling."""
