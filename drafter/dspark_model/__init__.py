"""The DSpark drafter network, checkpoint-compatible with DeepSpec's `Qwen3DSparkModel`.

A few Qwen3-style layers draft a whole block at once: the input is the anchor token followed
by `block_size - 1` mask tokens, queries attend bidirectionally inside the block and to the
target's projected hidden states of every earlier position (KV injection). A Markov head adds
a low-rank bias that depends on the previous draft token; a confidence head estimates the
per-position acceptance probability. Parameter names match DeepSpec exactly so its
checkpoints load as is.

One file per part: `config` (DSparkConfig, Calibration), `ops` (RMS norm, RoPE, attention),
`modules` (the layers and heads), `model` (DSparkModel), `sampling` (drawing a block) and
`checkpoint` (DeepSpec-format load and save). The names below are the public interface.
"""

from dspark_serve.drafter.dspark_model.checkpoint import (
    CALIBRATION_FILE,
    SHARED_PREFIXES,
    draft_head,
    load_dspark,
    read_calibration,
    read_config,
    save_calibration,
    save_dspark,
)
from dspark_serve.drafter.dspark_model.config import (
    ARCHITECTURE,
    MARKOV_HEAD_TYPES,
    Calibration,
    DSparkConfig,
)
from dspark_serve.drafter.dspark_model.model import DSparkModel
from dspark_serve.drafter.dspark_model.modules import (
    MLP,
    Attention,
    ConfidenceHead,
    DecoderLayer,
    MarkovHead,
    RMSNorm,
)
from dspark_serve.drafter.dspark_model.ops import apply_rope, attend, rms_norm, rope_cos_sin, rope_inv_freq
from dspark_serve.drafter.dspark_model.sampling import SampledBlock, sample_block

__all__ = [
    "ARCHITECTURE",
    "CALIBRATION_FILE",
    "MARKOV_HEAD_TYPES",
    "SHARED_PREFIXES",
    "Attention",
    "Calibration",
    "ConfidenceHead",
    "DSparkConfig",
    "DSparkModel",
    "DecoderLayer",
    "MLP",
    "MarkovHead",
    "RMSNorm",
    "SampledBlock",
    "apply_rope",
    "attend",
    "draft_head",
    "load_dspark",
    "read_calibration",
    "read_config",
    "rms_norm",
    "rope_cos_sin",
    "rope_inv_freq",
    "sample_block",
    "save_calibration",
    "save_dspark",
]
