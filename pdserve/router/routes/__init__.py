"""The router's HTTP routes, one module per concern: membership (instances join and leave), openai (client
requests, forwarded), operations (health, metrics)."""
