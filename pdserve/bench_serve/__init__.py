"""`pdserve bench serve`: a serving benchmark against any OpenAI-compatible server (seed 003's table)."""
