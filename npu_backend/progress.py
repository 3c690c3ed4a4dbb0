"""One tqdm bar for every long CLI job (calibration, repeated inferences, data sets, sweeps).

The ``progress`` extra; shown only on a terminal. The bar opens at the first report, so input refused
before any work never leaves a bar behind its error line.
"""

from __future__ import annotations

import sys


class ProgressBar:
    """A callback ``(done, total)`` fed with cumulative counts, as every job of the project reports them."""

    def __init__(self, desc: str, unit: str):
        self.desc, self.unit, self.bar = desc, unit, None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            try:
                from tqdm import tqdm
            except ImportError:
                self.bar = False
                return
            self.bar = tqdm(total=total, desc=self.desc, unit=self.unit, file=sys.stderr, disable=None)
        if self.bar:
            self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar:
            self.bar.close()
