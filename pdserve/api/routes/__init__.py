"""The API server's HTTP routes, one module per concern: openai (completions, chat, responses), tokens
(tokenize, detokenize), operations (health, metrics, models, the weights' clear and reload)."""
