"""Stage 4: write the shippable drafter: DeepSpec-format config.json + model.safetensors
(+ calibration.json), without the shared embedding / LM head, which the serving loader takes
from the target."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from dspark_serve.drafter.dspark_model import DSparkModel, save_dspark

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_drafter(
    model: DSparkModel, dest: str | os.PathLike, dtype: str = "bfloat16", metadata: dict | None = None
) -> Path:
    """Save `model` (calibration included) to `dest` with its weights cast to `dtype`."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    dest = Path(dest)
    # A standalone copy: casting `model` itself would also cast the target's shared modules.
    clone = DSparkModel(model.config)
    own = {k: v for k, v in model.state_dict().items() if not k.startswith(("embed_tokens.", "lm_head."))}
    clone.load_state_dict(own, strict=False)
    clone.calibration = model.calibration
    clone.to(DTYPES[dtype])
    save_dspark(clone, str(dest))
    if metadata:
        (dest / "training.json").write_text(json.dumps(metadata, indent=1))
    return dest


def directory_size(path: str | os.PathLike) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
