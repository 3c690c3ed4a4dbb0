"""Channels-first <-> channels-last copies of calibration batches, a tile at a time.

The integer sums of an NCHW model's layers are formed channels last (:mod:`.integer_sums`), so each such layer's
int8 input is transposed on its way in and its int8 output on its way out. numpy copies a transposed view element
by element in the destination's order, reading the source with a stride of a whole plane: every read misses the
cache, and the copy costs five times what a tiled one does (a tile of positions by all channels is read and
written while it is in cache). The values are the same whatever the tiling: only where they land moves.
"""

from __future__ import annotations

import numpy as np

from .batched_float import chunks
from .parallel import run_all

TILE_POSITIONS = 256
"""Positions (pixels) per tile: with every channel of them, the tile stays in the core's first-level caches."""


def _tiles(positions: int) -> list[slice]:
    return [slice(p, min(positions, p + TILE_POSITIONS)) for p in range(0, positions, TILE_POSITIONS)]


def to_channels_last(x: np.ndarray, out: np.ndarray, offset: float | None = None) -> None:
    """``out[n, 0, h, w, c] = x[n, 0, c, h, w] - offset`` (``offset``: None subtracts nothing) for a batch
    ``[N, 1, C, H, W]``, converted to ``out``'s type on the way; a sample chunk per worker thread."""
    n, c = x.shape[0], x.shape[2]
    src = x.reshape(n, c, -1)
    dst = out.reshape(n, -1, c)
    tiles = _tiles(src.shape[2])
    value = None if offset is None else np.array(offset, out.dtype)

    def part(rows: slice) -> None:
        for s in range(rows.start, rows.stop):
            for t in tiles:
                if value is None:
                    np.copyto(dst[s, t], src[s, :, t].T, casting="unsafe")
                else:
                    np.subtract(src[s, :, t].T, value, out=dst[s, t], dtype=out.dtype)

    run_all(part, chunks(n, src[0].size))


def to_channels_first(x: np.ndarray, out: np.ndarray) -> None:
    """``out[n, 0, c, h, w] = x[n, 0, h, w, c]`` for a batch ``[N, 1, H, W, C]`` (same type), on the calling
    thread (the caller already shares its work out by samples)."""
    n, c = x.shape[0], x.shape[-1]
    src = x.reshape(n, -1, c)
    dst = out.reshape(n, c, -1)
    tiles = _tiles(src.shape[1])
    for s in range(n):
        for t in tiles:
            np.copyto(dst[s, :, t], src[s, t].T)
