"""`dspark-train train-online` in its tiny mode: the GPU training run's whole path on a CPU
(DSpark and its DFlash twin on the same batches, the target run on the fly, checkpoints that
resume, calibration, exports split to a file-size limit that the serving loader reads back)."""

from __future__ import annotations

import json

import torch

from dspark_serve.drafter.dspark_model import load_dspark
from dspark_serve.training.cli import main
from dspark_serve.training.loss import LossConfig
from dspark_serve.training.online import OnlineConfig, build_pair, run_online, tiny_setup
from dspark_serve.training.train import TrainConfig

TINY = [
    "train-online", "--tiny", "--block-size", "4", "--markov-rank", "8", "--batch-seqs", "4",
    "--num-anchors", "8", "--checkpoint-every", "10", "--minutes", "3", "--threads", "1",
]  # fmt: skip


def _shared():
    target, _, _ = tiny_setup(0)
    return target.model.embed_tokens, target.lm_head


def log_steps(work) -> list[int]:
    return [json.loads(line)["step"] for line in (work / "log.jsonl").read_text().splitlines()]


def test_the_tiny_run_trains_both_resumes_and_exports_what_the_loader_reads(tmp_path):
    out = tmp_path / "run"
    assert main([*TINY, "--out", str(out), "--steps", "10", "--max-file-mib", "0.05"]) == 0
    work = out / "online"
    assert log_steps(work) == list(range(1, 11))
    report = json.loads((work / "export" / "report.json").read_text())
    assert report["steps_done"] == 10 and report["finished"]
    # a later window resumes from the checkpoint: the log goes on from step 11
    assert main([*TINY, "--out", str(out), "--steps", "24", "--max-file-mib", "0.05"]) == 0
    # (a truncated draft vocabulary: the ids the responses use)
    assert main([*TINY, "--out", str(tmp_path / "vocab"), "--steps", "4", "--draft-vocab", "40"]) == 0
    trunc = load_dspark(str(tmp_path / "vocab" / "online" / "export" / "dspark"), *_shared())
    assert (
        trunc.config.draft_vocab_size == 40 and trunc.d2t is not None and trunc.lm_head.weight.shape[0] == 40
    )
    assert log_steps(work) == list(range(1, 25))
    report = json.loads((work / "export" / "report.json").read_text())
    assert report["steps_done"] == 24 and set(report["exports"]) == {"dspark", "dflash"}
    for v in report["last"].values():  # both learned the sequences' repeats
        assert v["tau"] > 2.0
    target, _, _ = tiny_setup(0)
    for name, markov in (("dspark", 8), ("dflash", 0)):
        dest = work / "export" / name
        files = sorted(p.name for p in dest.glob("*.safetensors"))
        assert len(files) > 1 and all((dest / f).stat().st_size <= 0.05 * 2**20 for f in files)
        model = load_dspark(str(dest), target.model.embed_tokens, target.lm_head)
        assert model.config.markov_rank == markov and model.calibration is not None
        assert len(model.calibration.temperatures) == 4


def test_the_twins_start_equal_and_see_the_same_batches(tmp_path):
    target, train, held = tiny_setup(0)
    target.requires_grad_(False)
    from dspark_serve.drafter.dspark_model import DSparkConfig

    cfg = DSparkConfig.for_target(
        target.config,
        num_draft_layers=1,
        block_size=4,
        target_layer_ids=(0, 2, 3),
        mask_token_id=5,
        markov_rank=8,
        enable_confidence_head=True,
        confidence_head_with_markov=True,
    )
    pair = build_pair(cfg, target, init_from_target=True)
    a, b = pair["dspark"].state_dict(), pair["dflash"].state_dict()
    shared = [k for k in b if k in a and a[k].shape == b[k].shape]
    assert "layers.0.mlp.down_proj.weight" in shared and "fc.weight" in shared
    assert all(torch.equal(a[k], b[k]) for k in shared)
    assert pair["dflash"].markov_head is None and pair["dspark"].markov_head is not None
    # a budget too short for the steps: the run stops early, and still calibrates and exports
    run = OnlineConfig(TrainConfig(steps=10_000, batch_seqs=2, num_anchors=4, checkpoint_every=5, bf16=False),
                       minutes=0.01, reserve_minutes=0.0)  # fmt: skip
    report = run_online(target, cfg, run, LossConfig(), train, held, tmp_path / "w", tmp_path / "o")
    assert 0 < report.steps_done < 10_000 and not report.finished
    assert (tmp_path / "o" / "dspark" / "config.json").exists() and (tmp_path / "w" / "online.pt").exists()
