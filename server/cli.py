"""`dspark-serve`: parse flags (defaults from the component configs, then a config file, then the
command line), start the HTTP server at once, and load the engine in the background."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import tomllib
from pathlib import Path

from drafter.config import DRAFTER_CHOICES, DrafterConfig
from scheduler.config import SchedulerConfig
from server.config import ServerConfig
from verifier.config import ModelConfig

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_CONFIG = "embedded"
COMPONENTS = (ModelConfig, DrafterConfig, SchedulerConfig, ServerConfig)


def _flags() -> list[tuple[str, type, str, type]]:
    """(dest, component, help, argparse type) for every flag."""
    h = {
        "model": "embedded SmolLM2-135M-Instruct when omitted; or a directory (config + safetensors + tokenizer) or a .gguf file",
        "device": "auto, cpu or cuda", "dtype": "auto, float32, float16 or bfloat16",
        "max_model_len": "longest prompt + completion in tokens",
        "kv_cache_tokens": "token slots in the paged KV cache (0 = use --kv-cache-memory-fraction)",
        "kv_cache_memory_fraction": "with --kv-cache-tokens 0: fraction of free accelerator memory (CPU: RAM) for KV",
        "kv_block_size": "tokens per KV block",
        "forward": "fast | reference (the original per-module forward)",
        "linear": "auto | torch | mkldnn (oneDNN prepacked weights, CPU only)",
        "quantize": "none | int8 (weight-only, per channel; changes the target's outputs)",
        "cache_dir": "where GGUF conversions and cost tables are cached",
        "drafter": "|".join(DRAFTER_CHOICES), "drafter_path": "DeepSpec-format drafter checkpoint directory",
        "block_size": "most draft tokens per round (default: the drafter's)",
        "online_calibration": "refit the confidence head's per-position calibration from verification outcomes",
        "max_num_seqs": "most requests decoding at once",
        "max_num_batched_tokens": "token budget of one target forward",
        "max_waiting": "waiting-queue capacity (beyond it: HTTP 429)",
        "verify_policy": "none | static:K | threshold:T | dspark | auto (dspark when a drafter is on)",
        "reprofile": "re-measure the target cost table",
        "draft_gate": "with the dspark policy, skip drafting where it has not paid for itself",
        "enable_prefix_caching": "share the KV (and the drafter's context) of cached prompt prefixes across requests",
        "explore_every": "online-confidence drafters (ngram) verify >= 1 draft every n-th step",
        "draft_headroom": "dspark policy: draft at most this many positions past last step's budget (0 = full block)",
        "host": "interface to listen on", "port": "TCP port",
        "api_key": "require this bearer token on /v1/* (visible in the process list: prefer the "
                   "DSPARK_API_KEY environment variable or --api-key-file)",
        "api_key_file": "read the API key from this file at start-up",
        "served_model_name": "model name in the API",
        "max_body_bytes": "largest request body (bigger: HTTP 413)",
        "max_json_depth": "deepest JSON nesting accepted in a request body",
        "shutdown_timeout": "on SIGTERM: seconds in-flight requests may finish before their streams are cut",
        "log_level": "debug, info, warning or error",
    }
    out = []
    for comp in COMPONENTS:
        for f in dataclasses.fields(comp):
            t = {int: int, float: float, bool: bool}.get(type(f.default), str)
            out.append((f.name, comp, h.get(f.name, ""), t))
    return out


def build_parser(suppress_defaults: bool = False) -> argparse.ArgumentParser:
    """suppress_defaults: parse only the flags actually given (to layer them over a file)."""
    p = argparse.ArgumentParser(
        prog="dspark-serve", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        argument_default=argparse.SUPPRESS if suppress_defaults else None,
        description="OpenAI-compatible server with load-aware speculative decoding (DSpark).")
    p.add_argument("--config", **({} if suppress_defaults else {"default": DEFAULT_CONFIG}),
                   help="a name under configs/ (without .toml) or a path to a TOML file; flags override it")
    for name, comp, help_, typ in _flags():
        default = getattr(comp(), name)
        flag = "--" + name.replace("_", "-")
        kw = {} if suppress_defaults else {"default": default}
        if typ is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_, **kw)
        else:
            p.add_argument(flag, type=typ, help=help_, **kw)
    return p


def load_config_file(spec: str) -> dict:
    path = Path(spec)
    if not path.suffix:
        path = CONFIG_DIR / f"{spec}.toml"
    if not path.is_file():
        raise ValueError(f"config {spec!r} not found (looked for {path.name} in configs/)")
    data = tomllib.loads(path.read_text())
    flat: dict = {}
    for k, v in data.items():  # sections are optional: [model] device = "cpu" == device = "cpu"
        if isinstance(v, dict):
            flat.update(v)
        else:
            flat[k] = v
    known = {n for n, *_ in _flags()}
    unknown = sorted(set(flat) - known)
    if unknown:
        raise ValueError(f"unknown keys in config {path.name}: {unknown}")
    return flat


def resolve(argv: list[str] | None = None) -> tuple[ModelConfig, DrafterConfig, SchedulerConfig, ServerConfig]:
    parser = build_parser()
    args = parser.parse_args(argv)
    given = vars(build_parser(suppress_defaults=True).parse_args(argv))
    values = vars(parser.parse_args([]))           # the component configs' defaults
    values.update(load_config_file(args.config))    # then the config file
    values.update(given)                            # then the flags actually given
    for k in ("model", "drafter_path", "cache_dir", "api_key", "api_key_file", "served_model_name"):
        if values.get(k) in ("", "none", "None"):
            values[k] = None
    if values.get("block_size") in ("", "none", "None"):
        values["block_size"] = None
    elif values.get("block_size") is not None:
        values["block_size"] = int(values["block_size"])
    out = []
    for comp in COMPONENTS:
        out.append(comp(**{f.name: values[f.name] for f in dataclasses.fields(comp)}))
    return tuple(out)


API_KEY_ENV = "DSPARK_API_KEY"


def resolve_api_key(cfg: ServerConfig, environ) -> ServerConfig:
    """Fill `api_key` at start-up from `api_key_file` or, when neither is given, from the
    DSPARK_API_KEY environment variable (so the key need not be on the command line)."""
    if cfg.api_key_file is not None:
        try:
            key = Path(cfg.api_key_file).read_text().strip()
        except OSError as exc:
            raise ValueError(f"cannot read api_key_file {cfg.api_key_file!r}: {exc.strerror}") from exc
        if not key:
            raise ValueError(f"api_key_file {cfg.api_key_file!r} is empty")
        return dataclasses.replace(cfg, api_key=key, api_key_file=None)
    if cfg.api_key is None and environ.get(API_KEY_ENV):
        return dataclasses.replace(cfg, api_key=environ[API_KEY_ENV].strip())
    return cfg


def start_engine(model_cfg: ModelConfig, drafter_cfg: DrafterConfig, sched_cfg: SchedulerConfig,
                 server_cfg: ServerConfig):
    """Start loading the engine in its background thread; returns (AsyncEngine, the metrics'
    CollectorRegistry). Shared by `dspark-serve` and each Ray Serve replica."""
    from prometheus_client import CollectorRegistry

    # The engine side (torch) is imported only here, at run time: server/ modules never need it.
    from scheduler.async_engine import AsyncEngine
    from scheduler.builder import build_engine
    from scheduler.metrics import EngineMetrics

    registry = CollectorRegistry()
    name = server_cfg.served_model_name or (Path(model_cfg.model).stem if model_cfg.model else "SmolLM2-135M-Instruct")
    metrics = EngineMetrics(registry, name)
    engine = AsyncEngine(lambda on_stage=None: build_engine(model_cfg, drafter_cfg, sched_cfg, metrics,
                                                            on_stage=on_stage),
                         model_name=name, max_model_len=model_cfg.max_model_len)
    engine.start()
    return engine, registry


def main(argv: list[str] | None = None) -> None:
    try:
        model_cfg, drafter_cfg, sched_cfg, server_cfg = resolve(argv)
        server_cfg = resolve_api_key(server_cfg, os.environ)
    except ValueError as exc:
        print(f"dspark-serve: error: {exc}", file=sys.stderr)
        sys.exit(2)
    logging.basicConfig(level=server_cfg.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from server.app import build_app
    from server.serve import serve

    engine, registry = start_engine(model_cfg, drafter_cfg, sched_cfg, server_cfg)
    app = build_app(engine, server_cfg, registry)
    serve(app, engine, server_cfg.host, server_cfg.port, server_cfg.log_level,
          server_cfg.shutdown_timeout)
    engine.stop()


if __name__ == "__main__":
    main()
