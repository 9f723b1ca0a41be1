"""Overload control: what an engine reports of its queue (load.py), the TTFT/TPOT a new request would get
(predictor.py), and per-key rate limits (rate_limit.py); the router and `pdserve serve` refuse with 429."""
