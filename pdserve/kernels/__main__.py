"""`python -m pdserve.kernels [--allow-failure]`: build the CPU kernels now, printing the compiler's output.

`make venv` runs it with --allow-failure: pdserve still runs without the kernels, on a slower path.
"""

from __future__ import annotations

import sys
import time

from pdserve.kernels import build

if __name__ == "__main__":
    t = time.perf_counter()
    try:
        folder = build(verbose=True)
    except Exception as e:  # noqa: BLE001
        print(f"pdserve kernels: build failed ({e}); pdserve will run on its gather + SDPA attention path.")
        sys.exit(0 if "--allow-failure" in sys.argv else 1)
    print(f"pdserve kernels: built in {folder} ({time.perf_counter() - t:.1f} s)")
