"""`--max-step-rows auto`: the row cap chosen from the engine's own step times, as a bounded throughput cost.

A step's time is about a + b x rows: a fixed part (scheduling, batch preparation, the weights' passes
and the threads' synchronisation that every step pays) and a part per row. A cap of R rows keeps R / (a
+ b R) of the decode throughput an unbounded batch approaches (1 / b), i.e. a fraction b R / (a + b R);
asking for at least 1 - `MAX_THROUGHPUT_LOSS` of it gives the smallest such cap, R = ceil((1 - loss) /
loss x a / b). So the cap is small where rows are what costs (quantized weights on an idle CPU, as the
soak measured: a ~14 ms, b ~4.3 ms, R = 12-14) and large or off where a step's fixed part dominates (a
CPU so oversubscribed that each step waits on descheduled threads, as the shared machine of
benchmarks/results/soak.md, where a step's fixed part reached tens of ms; dense float32 weights, whose
GEMMs amortize over a batch, by the same rule, not measured), where a small cap would cost more than it
gives. The cost model is fitted on decode-only steps (every row one token) by least squares with
exponential forgetting, refitted every `UPDATE_EVERY` such steps, and only once the rows seen vary
enough to tell a from b; until then the cap is off. Measurements: benchmarks/results/soak.md ("Row
cap").
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.engine.step_rows import RowRotation

if TYPE_CHECKING:
    from kvserve.engine.step_trace import ScheduledRow

MAX_THROUGHPUT_LOSS = 0.2  # of decode throughput against an unbounded batch, at the fitted cost
HALF_LIFE_STEPS = 256  # decode-only steps after which a sample counts half
MIN_SAMPLES = 64  # decode-only steps before the first fit
UPDATE_EVERY = 32  # decode-only steps between fits
MIN_ROW_VARIANCE = 0.25  # rows per step must vary this much (rows^2) to separate a from b
logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StepCost:
    """Weighted least-squares fit of a step's seconds against its rows, older steps weighing less."""

    decay: float = 0.5 ** (1 / HALF_LIFE_STEPS)
    samples: int = 0
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # weight, x, y, xx, xy

    def add(self, rows: int, seconds: float) -> None:
        d, sums = self.decay, self._sums
        for index, value in enumerate((1.0, rows, seconds, rows * rows, rows * seconds)):
            sums[index] = sums[index] * d + value
        self.samples += 1

    def fit(self) -> tuple[float, float] | None:
        """(a, b) in seconds: fixed and per row; None until enough steps with varied rows, or if the
        fitted cost does not grow with rows."""
        if self.samples < MIN_SAMPLES:
            return None
        weight, sx, sy, sxx, sxy = self._sums
        mean_x, mean_y = sx / weight, sy / weight
        variance = sxx / weight - mean_x * mean_x
        if variance < MIN_ROW_VARIANCE:
            return None
        b = (sxy / weight - mean_x * mean_y) / variance
        if b <= 0:
            return None
        return max(0.0, mean_y - b * mean_x), b


def cap_for(a: float, b: float, max_num_seqs: int) -> int:
    """The smallest cap that keeps 1 - `MAX_THROUGHPUT_LOSS` of the decode throughput; 0 (off) when that
    is not below `max_num_seqs`."""
    rows = max(1, math.ceil((1 - MAX_THROUGHPUT_LOSS) / MAX_THROUGHPUT_LOSS * a / b))
    return 0 if rows >= max_num_seqs else rows


@dataclass(slots=True)
class AutoRowCap:
    """Sets `rotation.max_rows` from the step times the engine reports (`observe`, after each step)."""

    rotation: RowRotation
    max_num_seqs: int
    cost: StepCost = field(default_factory=StepCost)

    def observe(self, scheduled: Sequence[ScheduledRow], seconds: float) -> None:
        if not scheduled or any(item.num_new_tokens != 1 for item in scheduled):
            return  # a prefill chunk's cost is per token, not per row
        self.cost.add(len(scheduled), seconds)
        if self.cost.samples % UPDATE_EVERY:
            return
        fit = self.cost.fit()
        if fit is None:
            return
        cap = cap_for(*fit, self.max_num_seqs)
        if cap != self.rotation.max_rows:
            logger.info("max_step_rows auto: %d (a step ~ %.1f ms + %.1f ms a row; 0: off)",
                        cap, fit[0] * 1000, fit[1] * 1000)
            self.rotation.max_rows = cap


def make_auto_row_cap(max_step_rows: int | None, device: str, rotation: RowRotation,
                      max_num_seqs: int) -> AutoRowCap | None:
    """The auto cap for `max_step_rows` None on a CPU; None (a fixed cap, or off) otherwise: on an
    accelerator a step's cost hardly depends on its rows, so auto is off there."""
    if max_step_rows is not None or device.split(":")[0] != "cpu":
        return None
    return AutoRowCap(rotation, max_num_seqs)
