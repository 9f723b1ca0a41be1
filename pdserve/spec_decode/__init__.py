"""Speculative decoding: n-gram (prompt lookup) proposals, verified in the batch's own step.

`pdserve/config/speculative.py` holds vLLM's `--speculative-config`; `ngram_proposer.py` runs in the engine
(torch-free): after each step it proposes the tokens that followed the longest earlier match of a request's last
n-gram; `verifier.py` runs in the worker: it scores every proposed position in the same forward pass
and keeps the proposals the target model would have produced itself.
"""
