"""The router: instances register with it; it pairs a prefill and a decode instance per request."""
