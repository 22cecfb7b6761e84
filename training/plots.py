"""Saving the pipeline's and the benchmarks' figures compactly."""

from __future__ import annotations

import io
import os
from typing import Any


def save_png(fig: Any, path: str | os.PathLike, dpi: int) -> None:
    """Write a matplotlib figure as a 256-colour palette PNG.

    Line and bar plots use a handful of colours, so the palette keeps them visually identical
    while the file is much smaller than matplotlib's true-colour PNG (the benchmark results are
    committed, and the repository has a size budget)."""
    from PIL import Image  # matplotlib's own dependency

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    buf.seek(0)
    with Image.open(buf) as im:
        palette = im.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    palette.save(path, format="PNG", optimize=True)
