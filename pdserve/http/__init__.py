"""What the API server and the router share on the wire: the OpenAI error body, bearer-key checks,
chat content parts, client disconnects. Neither imports the other; both import this."""
