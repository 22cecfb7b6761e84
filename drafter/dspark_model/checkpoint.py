"""Checkpoint I/O in DeepSpec's format: config.json + *.safetensors (+ calibration.json)."""

from __future__ import annotations

import glob
import json
import os
from typing import cast

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from dspark_serve.drafter.dspark_model.config import Calibration, DSparkConfig
from dspark_serve.drafter.dspark_model.model import DSparkModel
from dspark_serve.drafter.dspark_model.ops import rope_inv_freq

CALIBRATION_FILE = "calibration.json"
# Keys a training framework may put in front of the parameter names.
_KEY_PREFIXES = ("_orig_mod.", "module.", "model.", "draft_model.")
# The target's modules the drafter shares (not saved unless asked, never read when shared).
SHARED_PREFIXES = ("embed_tokens.", "lm_head.")


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, name) for name in names]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path!r}")
    return files


def _normalize_key(key: str, expected: set[str]) -> str:
    """Strip training-framework prefixes ("model.", "_orig_mod.", ...) from unknown keys."""
    k = key
    while k not in expected and k.startswith(_KEY_PREFIXES):
        k = k.split(".", 1)[1]
    return k if k in expected else key


def _read_state_dict(path: str, expected: set[str], skip: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors under normalized names; keys starting with `skip` are never read
    (real checkpoints carry vocab-sized copies of the target's embedding and LM head)."""
    state: dict[str, torch.Tensor] = {}
    for name in _weight_files(path):
        with safe_open(name, framework="pt", device="cpu") as f:
            for key in f.keys():
                k = _normalize_key(key, expected)
                if not (skip and k.startswith(skip)):
                    state[k] = f.get_tensor(key)
    return state


def read_config(path: str) -> DSparkConfig:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise ValueError(f"no config.json in drafter checkpoint {path!r}")
    with open(cfg_path) as f:
        return DSparkConfig.from_json_dict(json.load(f))


def read_calibration(path: str) -> Calibration | None:
    cal_path = os.path.join(path, CALIBRATION_FILE)
    if not os.path.exists(cal_path):
        return None
    with open(cal_path) as f:
        return Calibration.from_json_dict(json.load(f))


def _exact_device(device: torch.device | str) -> torch.device:
    """ "cuda" -> "cuda:<current>", so device identity checks are exact."""
    dev = torch.device(device)
    if str(dev) == "cuda":  # no index given
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def load_dspark(
    path: str,
    target_embed: nn.Embedding | None = None,
    target_lm_head: nn.Linear | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    drop_markov_head: bool = False,
) -> DSparkModel:
    """Load a DeepSpec-format drafter (config.json + *.safetensors [+ calibration.json]).

    The target's embedding / LM head are shared by reference when given (the drafter's
    copies are frozen target weights anyway, and not even read); otherwise the checkpoint
    must contain them. drop_markov_head: load as DFlash (no Markov correction); a
    confidence head that reads W1[x_prev] is dropped with it, since its input is gone."""
    cfg = read_config(path)
    if drop_markov_head and cfg.has_markov:
        conf = cfg.enable_confidence_head and not cfg.confidence_uses_markov
        cfg = cfg.replace(markov_rank=0, enable_confidence_head=conf, confidence_head_with_markov=False)
    if (target_embed is None) != (target_lm_head is None):
        raise ValueError("pass both target_embed and target_lm_head, or neither")
    dev = _exact_device(device)
    embed = cast(nn.Embedding, _as_shared(target_embed, dev, dtype)) if target_embed is not None else None
    # A truncated vocabulary's head is cut from the target's once d2t is read (below).
    head = (
        cast(nn.Linear, _as_shared(target_lm_head, dev, dtype))
        if target_lm_head is not None and not cfg.truncated
        else None
    )
    with torch.device("meta"):  # no throwaway random init of weights the checkpoint replaces
        model = DSparkModel(cfg, embed, head)
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    skip = SHARED_PREFIXES if target_embed is not None else ()
    state = _read_state_dict(path, set(own), skip)
    if drop_markov_head:  # the heads' weights the DFlash model has no place for
        heads = ("markov_head.", "confidence_head.")
        state = {k: v for k, v in state.items() if k in own or not k.startswith(heads)}
    _check_state(path, cfg, state, own, skip)
    model.load_state_dict(
        {k: v.to(device=dev) if k == "d2t" else v.to(device=dev, dtype=dtype) for k, v in state.items()},
        strict=False,
        assign=True,
    )
    if cfg.truncated:
        _attach_draft_vocabulary(model, path, target_lm_head, dev, dtype)
    model.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(dev)
    model.calibration = read_calibration(path)
    return model.eval()


def _check_state(
    path: str,
    cfg: DSparkConfig,
    state: dict[str, torch.Tensor],
    own: dict[str, tuple[int, ...]],
    skip: tuple[str, ...],
) -> None:
    """The checkpoint's weights are exactly the model's (less the shared ones skipped), each
    of the shape the config implies; a truncated vocabulary comes with its d2t map."""
    unexpected = sorted(set(state) - set(own))
    if unexpected:
        raise ValueError(f"unexpected weights in {path!r}: {unexpected[:8]}")
    if cfg.truncated and "d2t" not in state:
        raise ValueError(f"{path!r}: draft_vocab_size is {cfg.draft_vocab_size} but there is no d2t map")
    missing = sorted(k for k in set(own) - set(state) if not (skip and k.startswith(skip)))
    if missing:
        hint = (
            " (embed_tokens / lm_head are not in the checkpoint: pass the target's)"
            if any(k.startswith(SHARED_PREFIXES) for k in missing)
            else ""
        )
        raise ValueError(f"missing weights in {path!r}: {missing[:8]}{hint}")
    for key, value in state.items():
        if tuple(value.shape) != own[key]:
            raise ValueError(f"weight {key!r} has shape {tuple(value.shape)}, config implies {own[key]}")


def _attach_draft_vocabulary(
    model: DSparkModel, path: str, target_lm_head: nn.Linear | None, dev: torch.device, dtype: torch.dtype
) -> None:
    """Check a truncated vocabulary's d2t map, and cut the draft head from the target's."""
    cfg, d2t = model.config, model.d2t
    assert d2t is not None  # a truncated config makes the buffer
    if d2t.min() < 0 or d2t.max() >= cfg.vocab_size or torch.unique(d2t).numel() != d2t.numel():
        raise ValueError(f"{path!r}: d2t must list distinct target ids in [0, {cfg.vocab_size})")
    if target_lm_head is not None:
        model.lm_head = draft_head(target_lm_head, d2t, dev, dtype)


def draft_head(
    lm_head: nn.Module,
    d2t: torch.Tensor,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> nn.Linear:
    """The rows of a target LM head that a truncated draft vocabulary keeps (frozen copy)."""
    w = cast(torch.Tensor, lm_head.weight)
    dev, dt = device or w.device, dtype or w.dtype
    head = nn.Linear(w.shape[1], d2t.numel(), bias=False, device=dev, dtype=dt)
    with torch.no_grad():
        head.weight.copy_(w.detach()[d2t.to(w.device)].to(device=dev, dtype=dt))
    return head.requires_grad_(False)


def _as_shared(mod: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The target module itself when it already lives on device/dtype, else a frozen copy."""
    w = cast(torch.Tensor, mod.weight)
    new: nn.Module
    if w.device == device and w.dtype == dtype:
        return mod
    if isinstance(mod, nn.Embedding):
        new = nn.Embedding(w.shape[0], w.shape[1], device=device, dtype=dtype)
    else:
        new = nn.Linear(
            w.shape[1], w.shape[0], bias=getattr(mod, "bias", None) is not None, device=device, dtype=dtype
        )
    with torch.no_grad():
        new.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in mod.state_dict().items()})
    return new.requires_grad_(False)


def save_dspark(model: DSparkModel, path: str, include_shared: bool = False) -> None:
    """Write config.json + model.safetensors (+ calibration.json) in DeepSpec's format."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model.config.to_json_dict(), f, indent=2)
    state = {
        k: v.detach().to("cpu").contiguous().clone()
        for k, v in model.state_dict().items()
        if include_shared or not k.startswith(SHARED_PREFIXES)
    }
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    if model.calibration is not None:
        save_calibration(model.calibration, path)


def save_calibration(calibration: Calibration, path: str) -> None:
    with open(os.path.join(path, CALIBRATION_FILE), "w") as f:
        json.dump(calibration.to_json_dict(), f, indent=2)
