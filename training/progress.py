"""Progress of a pipeline stage: a bar on the terminal and a JSON file others can poll."""

from __future__ import annotations

import json
import time
from pathlib import Path


class Progress:
    """A tqdm bar plus a JSON file others can poll (`<out>/progress/<stage>.json`)."""

    def __init__(self, out: str, stage: str, total: int, unit: str):
        from tqdm import tqdm

        self.path = Path(out) / "progress" / f"{stage}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.bar = tqdm(total=total, desc=stage, unit=unit, dynamic_ncols=True, mininterval=2.0)
        self.stage, self.t0 = stage, time.time()

    def update(self, done: int, total: int, **info) -> None:
        self.bar.total = total
        self.bar.n = done
        if info:
            self.bar.set_postfix({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in info.items()})
        self.bar.refresh()
        self.path.write_text(
            json.dumps(
                {
                    "stage": self.stage,
                    "done": done,
                    "total": total,
                    "elapsed_s": round(time.time() - self.t0, 1),
                    **info,
                }
            )
        )

    def close(self) -> None:
        self.bar.close()
