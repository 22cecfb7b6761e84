"""Assemble an engine from the three component configs."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dspark_serve.drafter.base import Drafter
from dspark_serve.drafter.config import NO_DRAFTER, DrafterConfig
from dspark_serve.drafter.dspark_model.config import DSparkConfig
from dspark_serve.drafter.registry import build_drafter, drafter_spec
from dspark_serve.ops.cpu_kernels import describe_cpu, load_kernels, prepare_kernels
from dspark_serve.ops.platform import default_cache_dir
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.scheduler.engine import Engine, HiddenCapture
from dspark_serve.scheduler.memory_plan import MemoryPlan, TargetGeometry, parameter_bytes, plan_memory
from dspark_serve.scheduler.metrics_sink import EngineMetricsSink
from dspark_serve.scheduler.policy import CostTable, DSparkPolicy, parse_policy
from dspark_serve.verifier.config import ModelConfig
from dspark_serve.verifier.cuda_graphs import TOKEN_BUCKETS
from dspark_serve.verifier.forward import ModelParts
from dspark_serve.verifier.gguf_blocks import (
    ModelBlocks,
    forget_gguf_files,
    quantize_blocks,
    read_gguf_blocks,
)
from dspark_serve.verifier.host_memory import retain_freed_memory
from dspark_serve.verifier.loader import (
    DtypeChoice,
    WeightsChoice,
    choose_dtype,
    choose_weights,
    load_target,
    resolve_device,
)
from dspark_serve.verifier.model_runner import ModelRunner

log = logging.getLogger(__name__)

# The embedded model ships one drafter checkpoint, used by every drafter built from one
# (`dflash` serves it without its Markov head and the confidence head that reads it: the
# DFlash ablation of the same weights).
EMBEDDED_DRAFTER = Path(__file__).resolve().parent.parent / "drafter" / "checkpoints" / "smollm2-135m-dspark"


@dataclass
class EngineBundle:
    """A built engine, the tokenizer of its target, and the dtype and weights chosen for it
    (and why)."""

    engine: Engine
    tokenizer: Any
    dtype: DtypeChoice
    weights: WeightsChoice | None = None
    weights_detail: str = ""


def kv_cache_tokens(cfg: ModelConfig, hf_config: Any, dtype: torch.dtype) -> int:
    """KV tokens on a CPU: the configured count, or kv_cache_memory_fraction of the RAM."""
    if cfg.kv_cache_tokens:
        return cfg.kv_cache_tokens
    per_token = ModelRunner.kv_bytes_per_token(hf_config, dtype)
    budget = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * cfg.kv_cache_memory_fraction
    return max(int(budget // per_token), cfg.max_model_len)


@dataclass(frozen=True)
class DrafterFootprint:
    modules: tuple[torch.nn.Module, ...]
    tap_width: int
    context_per_token: int


def drafter_footprint(drafter: Drafter | None, hidden_size: int) -> DrafterFootprint:
    """What a drafter adds to device memory: its weights' modules, the tap rows the prefix cache
    keeps per KV slot, and its context K/V bytes per position (DSpark/DFlash models)."""
    if drafter is None:
        return DrafterFootprint((), 0, 0)
    model = getattr(drafter, "model", None)
    modules = (model,) if isinstance(model, torch.nn.Module) else ()
    taps = len(getattr(drafter, "tap_layers", ()) or ())
    cfg = getattr(model, "config", None)
    per_position = 0
    if isinstance(cfg, DSparkConfig) and isinstance(model, torch.nn.Module):
        elt = next(model.parameters()).element_size()
        per_position = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * elt
    return DrafterFootprint(modules, taps * hidden_size, per_position)


def device_memory_plan(
    model_cfg: ModelConfig,
    sched_cfg: SchedulerConfig,
    target: Any,
    drafter: Drafter | None,
    dtype: torch.dtype,
    device_bytes: int,
    max_model_len: int,
) -> MemoryPlan:
    """The accelerator's memory plan (`scheduler/memory_plan.py`) for this target and drafter,
    logged as a table."""
    geometry = TargetGeometry.of(target.model.config)
    foot = drafter_footprint(drafter, geometry.hidden_size)
    block = drafter.block_size if drafter is not None else 0
    plan = plan_memory(
        device_bytes=device_bytes,
        utilization=model_cfg.gpu_memory_utilization,
        weights=parameter_bytes((target.model, *foot.modules)),
        target=geometry,
        elt=torch.tensor([], dtype=dtype).element_size(),
        max_model_len=max_model_len,
        max_num_seqs=sched_cfg.max_num_seqs,
        max_num_batched_tokens=sched_cfg.max_num_batched_tokens,
        max_logit_rows=sched_cfg.max_num_seqs * (2 + 2 * block),  # a block and a branch each
        tap_width=foot.tap_width if sched_cfg.enable_prefix_caching else 0,
        drafter_context_per_token=foot.context_per_token,
        graph_tokens=max(TOKEN_BUCKETS) if model_cfg.cuda_graphs else 0,
    )
    log.info("memory plan:\n%s", plan.table())
    return plan


def build_drafter_for(
    cfg: DrafterConfig,
    target: Any,
    device: torch.device,
    dtype: torch.dtype,
    model_is_embedded: bool,
    cuda_graphs: bool = False,
) -> Drafter | None:
    if cfg.drafter == NO_DRAFTER:
        return None
    path = cfg.drafter_path
    if path is None and drafter_spec(cfg.drafter).uses_checkpoint:
        if not model_is_embedded:
            raise ValueError(f"drafter {cfg.drafter!r} needs --drafter-path for a non-embedded model")
        path = str(EMBEDDED_DRAFTER)
        if not EMBEDDED_DRAFTER.is_dir():
            raise ValueError(f"the shipped {cfg.drafter} drafter is missing ({EMBEDDED_DRAFTER.name})")
    return build_drafter(
        cfg.drafter,
        path=path,
        target_model=target.model,
        block_size=cfg.block_size,
        device=device,
        dtype=dtype,
        online_calibration=cfg.online_calibration,
        cuda_graphs=cuda_graphs,
    )


def target_blocks(choice: WeightsChoice, target: Any) -> ModelBlocks | None:
    """The target's products as blocks where `choice` serves them so (the file's, or Q8_0 made
    from the floats), checked against the loaded weights; None for dense weights."""
    if choice.kind == "dense":
        return None
    if load_kernels() is None:  # chosen where a compiler is, but the build failed (logged)
        log.warning("the block kernels could not be built: the products stay dense float32")
        return None
    parts = ModelParts.of(target.model)
    if choice.kind == "gguf":
        assert choice.gguf is not None
        return read_gguf_blocks(choice.gguf, parts)
    return quantize_blocks(parts, "Q8_0")


def build_runner(
    model_cfg: ModelConfig,
    target: Any,
    device: torch.device,
    dtype: torch.dtype,
    tokens: int = 0,
    blocks: ModelBlocks | None = None,
) -> ModelRunner:
    """The target's runner with a KV cache of `tokens` slots (0: sized by the config on a CPU,
    `kv_cache_tokens`); blocks: its products served from GGUF blocks."""
    tokens = tokens or kv_cache_tokens(model_cfg, target.model.config, dtype)
    runner = ModelRunner(
        target.model,
        num_blocks=max(1, tokens // model_cfg.kv_block_size),
        block_size=model_cfg.kv_block_size,
        impl=model_cfg.forward,
        linear=model_cfg.linear,
        quantize=model_cfg.quantize,
        attention=model_cfg.attention,
        gemm_rows=model_cfg.gemm_rows,
        cuda_graphs=model_cfg.cuda_graphs,
        max_model_len=model_cfg.max_model_len,
        batch_invariant=model_cfg.batch_invariant,
        blocks=blocks,
    )
    log.info("target forward: %s", runner.describe())
    if runner.released_bytes:
        log.info("released the float copies of the block products (%.0f MiB)", runner.released_bytes / 2**20)
    kv = runner.kv
    log.info("KV cache: %d blocks x %d tokens (%.0f MiB)", kv.num_blocks, kv.block_size, kv.nbytes / 2**20)
    return runner


@dataclass(frozen=True)
class TableChoice:
    """The cost table an engine starts on: its source ("cached", "measured", "provisional" or
    "none") and, for a provisional one, where the full table measured in idle gaps is cached."""

    table: CostTable | None
    source: str
    measure_to: Path | None = None


def cost_table_for(
    runner: ModelRunner,
    target: Any,
    cache_dir: Path,
    sched_cfg: SchedulerConfig,
    drafting: bool,
    profile: bool | None,
    stage: Callable[[str], None],
) -> TableChoice:
    """The cost table, where the policy reads one (by default only the load-aware policy with a
    drafter does): the cached one; else, measured in the background (`cost_table_in_background`),
    a provisional one from a short probe; else measured before serving."""
    if profile is None:
        profile = drafting and isinstance(parse_policy(sched_cfg.policy_spec(drafting=True)), DSparkPolicy)
    if not profile:
        return TableChoice(None, "none")
    from dspark_serve.scheduler.profile import format_table, load_or_profile, probe, read_cached, table_path

    if not sched_cfg.cost_table_in_background:
        stage("loading or measuring the cost table")
        table, raw, source = load_or_profile(runner, target.name, cache_dir, sched_cfg.reprofile)
        log.info("cost table (%s):\n%s", source, format_table(raw))
        return TableChoice(table, source.split()[0])
    path = table_path(runner, target.name, cache_dir)
    cached = None if sched_cfg.reprofile else read_cached(path)
    if cached is not None:
        log.info("cost table (cached %s):\n%s", path.name, format_table(cached))
        return TableChoice(CostTable.from_dict(cached), "cached")
    stage("probing the cost table")
    raw = probe(runner)
    log.info(
        "cost table: provisional, from a %.1fs probe; the full table is measured in the engine's "
        "idle gaps and takes over when done (first start on this machine; cached afterwards):\n%s",
        raw["seconds"],
        format_table(raw),
    )
    return TableChoice(CostTable.from_dict(raw), "provisional", path)


def measure_when_idle(engine: Engine, choice: TableChoice, metrics: EngineMetricsSink | None) -> None:
    """Under a provisional table: the full one is measured in the engine's idle gaps
    (`scheduler/idle_profile.py`) and takes over when done."""
    from dspark_serve.scheduler.idle_profile import IdleProfile
    from dspark_serve.scheduler.profile import TableMeasurement, format_table

    def adopt(table: CostTable, raw: dict[str, Any]) -> None:
        engine.speculation.use_table(table)
        if metrics is not None:
            metrics.set_cost_table(table, "measured")
        log.info("cost table (measured in idle gaps), in force from now:\n%s", format_table(raw))

    measurement = TableMeasurement(engine.runner, engine.blocks)
    engine.idle_profile = IdleProfile(measurement, choice.measure_to, adopt)


def _weights_for(model_cfg: ModelConfig, device: torch.device) -> WeightsChoice:
    """The target's weights and dtype (`--weights`, `--dtype`), logged with their reasons."""
    fast = model_cfg.forward == "fast" and model_cfg.quantize == "none"
    weights = choose_weights(model_cfg.weights, model_cfg.dtype, device, model_cfg.model, fast)
    choice = weights.dtype
    log.info("target dtype %s on %s (%s)", choice.name, device, choice.reason)
    log.info("target weights: %s", weights.reason)
    return weights


def build_engine(
    model_cfg: ModelConfig,
    drafter_cfg: DrafterConfig,
    sched_cfg: SchedulerConfig,
    metrics: EngineMetricsSink | None = None,
    profile: bool | None = None,
    capture: Callable[[int], HiddenCapture] | None = None,
    on_stage: Callable[[str], None] | None = None,
) -> EngineBundle:
    """`capture(num_layers)` builds a hidden-state capture for training-data generation;
    on_stage: told what is being loaded, step by step (for /health and the log)."""
    stage = on_stage or (lambda s: None)
    device = resolve_device(model_cfg.device)
    if device.type == "cpu":
        prepare_kernels()  # a first start compiles them while it reads the model
    weights = _weights_for(model_cfg, device)
    choice = weights.dtype
    dtype = choice.dtype
    cache_dir = Path(model_cfg.cache_dir) if model_cfg.cache_dir else default_cache_dir()
    stage("loading the target model")
    target = load_target(model_cfg.model, device, dtype, cache_dir)
    stage("reading the weight blocks")
    blocks = target_blocks(weights, target)
    model_len = getattr(target.model.config, "max_position_embeddings", model_cfg.max_model_len)
    max_len = min(model_cfg.max_model_len, model_len)
    stage("loading the drafter")
    # the drafter keeps the dtype --dtype picks (bf16 where the CPU computes it natively) when
    # the target's products are blocks beside float32 activations
    drafter_dtype = dtype if weights.kind == "dense" else choose_dtype(model_cfg.dtype, device).dtype
    drafter = build_drafter_for(
        drafter_cfg, target, device, drafter_dtype, model_cfg.model is None, model_cfg.cuda_graphs
    )
    tokens = model_cfg.kv_cache_tokens
    if device.type == "cuda" and not tokens:  # the KV cache gets what the plan leaves
        total = torch.cuda.mem_get_info(device)[1]
        tokens = device_memory_plan(model_cfg, sched_cfg, target, drafter, dtype, total, max_len).kv_tokens
    runner = build_runner(model_cfg, target, device, dtype, tokens, blocks)
    if device.type == "cpu":  # what the CPU is and what the kernels were built for
        log.info("CPU: %s", describe_cpu())
    detail = blocks.describe() if blocks is not None else f"dense {choice.name}"
    del blocks  # the forward holds its packed products; the file's map goes with the blocks
    forget_gguf_files()
    # after the weights and the KV cache: those keep their own mappings
    if device.type == "cpu" and retain_freed_memory(model_cfg.retain_freed_mib):
        log.info("freed host blocks of up to %d MiB are kept for the next step", model_cfg.retain_freed_mib)
    costs = cost_table_for(runner, target, cache_dir, sched_cfg, drafter is not None, profile, stage)
    layers = runner.num_layers
    engine = Engine(
        runner,
        target.tokenizer,
        sched_cfg,
        max_len,
        drafter=drafter,
        cost_table=costs.table,
        metrics=metrics,
        capture=None if capture is None else capture(layers),
    )
    if metrics is not None and costs.table is not None:
        metrics.set_cost_table(costs.table, costs.source)
    if costs.source == "provisional":
        measure_when_idle(engine, costs, metrics)
    if drafter is not None:
        policy = engine.speculation.policy.name
        log.info("drafter %s (block %d), verify policy %s", drafter.name, drafter.block_size, policy)
    return EngineBundle(engine, target.tokenizer, choice, weights, detail)
