"""The engine on the default model with `--weights native` (its Q4_1/Q8_0 as stored) against `--weights dense`
(float32): batch 8 / 32 / 64 and prefill 512 / 2,048 tokens. The same as `python benchmarks/qgemm.py
--end-to-end` (see there), as its own command for run_all.

    python benchmarks/qgemm_end_to_end.py              # about 3 minutes on 2 idle cores
    python benchmarks/qgemm_end_to_end.py --threads 1  # one core: steadier on a busy machine
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import qgemm  # noqa: E402

if __name__ == "__main__":
    sys.argv.insert(1, "--end-to-end")
    qgemm.main()
