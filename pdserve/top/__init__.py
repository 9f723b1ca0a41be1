"""`pdserve top`: a deployment's live view in the terminal (rich), from a router's GET /cluster."""
