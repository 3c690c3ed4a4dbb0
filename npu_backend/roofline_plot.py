"""A PNG of per-layer cycles by engine against the roofline (needs matplotlib: the ``plot`` extra).

Per layer, three bars: the cycles the compute units and the DMA engine were busy with it, and its elapsed
span; and two floors: the compute roofline (MACs / (mac_rows * mac_cols): the array fully used) and the DMA
roofline (DRAM bytes / dram_bytes_per_cycle: the port saturated). A span far above both floors is time lost to
fixed costs, idle array lanes or waiting; a span near its DMA floor is memory-bound. The y axis is logarithmic:
a network's layers span several decades of cycles. Drawn on a bare ``Figure``: no pyplot state, no backend
switched for the caller.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

from .errors import NpuError

BARS = (("compute_busy", "compute busy", "tab:blue"), ("dma_busy", "DMA busy", "tab:orange"),
        ("span", "elapsed (span)", "tab:gray"))
"""(LayerRow field, legend, colour) of each bar of a layer, left to right."""

FLOORS = (("compute_floor", "compute roofline: MACs / array size", "black", "solid"),
          ("dma_floor", "DMA roofline: bytes / DRAM bytes per cycle", "tab:red", "dashed"))
"""(LayerRow property, legend, colour, line style) of each floor drawn across a layer's bars."""


def require_matplotlib() -> None:
    """Raise ``NpuError`` unless matplotlib can be imported (``npu run --plot`` checks before it runs)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise NpuError("plotting needs matplotlib: pip install 'npu-backend[plot]'")


def plot_layers(rows: Sequence, path, title: str) -> None:
    """Write the plot of ``rows`` (:class:`npu_backend.profiling.LayerRow`) to ``path`` as a PNG."""
    require_matplotlib()
    from matplotlib.figure import Figure

    if not rows:
        raise NpuError("nothing to plot: the profile holds no NPU call")
    regions = {row.region for row in rows}
    labels = [row.layer if len(regions) == 1 else f"{row.region}:{row.layer}" for row in rows]
    width = 0.8 / len(BARS)
    fig = Figure(figsize=(max(6.0, 0.35 * len(rows) + 2), 4.8))
    ax = fig.add_subplot()
    for k, (attribute, legend, colour) in enumerate(BARS):
        offset = (k - (len(BARS) - 1) / 2) * width
        ax.bar([x + offset for x in range(len(rows))], [getattr(row, attribute) for row in rows], width,
               label=legend, color=colour)
    for attribute, legend, colour, style in FLOORS:
        points = [(x, getattr(row, attribute)) for x, row in enumerate(rows) if getattr(row, attribute) > 0]
        if points:
            ax.hlines([y for _, y in points], [x - 0.45 for x, _ in points], [x + 0.45 for x, _ in points],
                      colors=colour, linestyles=style, label=legend)
    ax.set_yscale("log")
    ax.set_xticks(range(len(rows)), labels, rotation=70, ha="right", fontsize=7)
    summed = any(row.calls > 1 for row in rows)
    ax.set_ylabel("cycles" + (" (summed over a region's calls)" if summed else ""))
    configs = sorted({row.config.name for row in rows})
    ax.set_title(f"Per-layer cycles on {', '.join(configs)}: {title}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    try:
        fig.savefig(path, format="png", dpi=120)
    except OSError as exc:
        raise NpuError(f"cannot write the plot to {path}: {exc.strerror}") from None
