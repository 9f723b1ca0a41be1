"""KV events: what each engine's prefix cache holds, published as it changes (vLLM's format), and the
routers' exact index built from them."""
