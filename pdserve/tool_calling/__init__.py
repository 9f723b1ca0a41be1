"""Tool calling for the chat API: tools in the prompt (prompt.py), `required` and named calls enforced
by a grammar (grammar.py), and tool calls read back from the model's text (parsers.py)."""
