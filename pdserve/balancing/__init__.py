"""Picking one of several serving endpoints for a request, by load and prompt prefix: the router's policies
over instances, and the API server's over its data-parallel engine ranks (the same code)."""
