"""Text <-> token ids: the tokenizer with its chat template, and incremental detokenization with stop strings."""
