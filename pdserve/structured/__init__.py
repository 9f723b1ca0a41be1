"""Structured outputs: grammars that constrain sampling (JSON schema, regex, choice, Lark/GBNF). The
spec (spec.py) is torch-free and travels in SamplingParams; the matchers (matcher.py) run in the
worker beside the sampler. The tool-call grammar (tool_call_grammar.py) is here too; pdserve/tool_calling
parses the calls it writes."""
