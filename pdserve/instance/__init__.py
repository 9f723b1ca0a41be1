"""One instance put together, whatever its role: which of its processes starts first and who creates the KV
cache (startup.py, the truth table), and its engine core with the role's PD connector plugged in (build.py).
Above both pdserve.engine and pdserve.disagg; the engine process's entry (engine/__main__.py) runs it."""
