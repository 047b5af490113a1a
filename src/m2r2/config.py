"""Model configuration: one dataclass, read from a Hugging Face ``config.json``.

We keep our own config instead of passing transformers' ``PretrainedConfig`` around so the model
code stays independent of transformers' version-to-version renames (``rope_scaling`` in v4,
``rope_parameters`` in v5) and so tiny test models can be built from a few keyword arguments.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from m2r2.errors import UnsupportedModelError

#: ``model_type`` values whose checkpoints share the Llama block layout that ``model.py`` implements.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
#: RoPE variants implemented in :func:`rope_inv_freq`.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2)."""

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    sliding_window: int | None = None
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_kv_heads < 1:
            raise UnsupportedModelError(f"head counts must be positive, got {self.num_heads} / {self.num_kv_heads}")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from the dict of an HF ``config.json`` (transformers v4 or v5 spelling)."""
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; m2r2 runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only silu / SwiGLU)")
        if d.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias=true is not supported")
        # transformers: Qwen2 always has q/k/v biases, Mistral never; Llama's flag also biases o_proj.
        if model_type == "llama" and d.get("attention_bias"):
            raise UnsupportedModelError("attention_bias=true (biased q/k/v/o projections) is not supported for llama")
        # transformers v5 folds rope_theta and rope_scaling into rope_parameters.
        rope = dict(d.get("rope_parameters") or {})
        theta = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
        scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            scaling = dict(scaling)
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind not in SUPPORTED_ROPE_TYPES:
                raise UnsupportedModelError(
                    f"rope scaling {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
                )
            if kind == "default":
                scaling = None
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        # Qwen2 configs carry sliding_window but disable it with use_sliding_window=false.
        window = d.get("sliding_window")
        if d.get("use_sliding_window") is False:
            window = None
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            rope_theta=theta,
            rope_scaling=scaling,
            # transformers' Llama/Mistral/Qwen2 configs all default to untied heads.
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2",
            sliding_window=int(window) if window else None,
            model_type=model_type,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise UnsupportedModelError(f"cannot read model config {path}: {e}") from e
        if not isinstance(d, dict):
            raise UnsupportedModelError(f"model config {path} is not a JSON object")
        try:
            return cls.from_hf_dict(d)
        except KeyError as e:
            raise UnsupportedModelError(f"model config {path} lacks the field {e}") from e
        except (TypeError, ValueError, ZeroDivisionError) as e:
            raise UnsupportedModelError(f"model config {path} has an invalid value: {e}") from e

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def rope_inv_freq(cfg: ModelConfig) -> tuple[list[float], float]:
    """Inverse RoPE frequencies and the attention scaling factor for ``cfg``'s RoPE variant.

    Returns plain floats so the caller decides device and dtype (always float32 for accuracy).
    Formulas follow the published definitions (Su et al. for default, Meta's Llama 3.1 release
    for ``llama3``, Peng et al. for YaRN) as transformers implements them, which the parity tests
    check.
    """
    dim = cfg.head_dim
    base = cfg.rope_theta
    inv = [1.0 / (base ** (i / dim)) for i in range(0, dim, 2)]
    s = cfg.rope_scaling or {}
    kind = cfg.rope_type
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        f = float(s["factor"])
        return [x / f for x in inv], 1.0
    if kind == "llama3":
        factor = float(s["factor"])
        low = float(s.get("low_freq_factor", 1.0))
        high = float(s.get("high_freq_factor", 4.0))
        old_ctx = float(s.get("original_max_position_embeddings") or cfg.max_position_embeddings)
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        out = []
        for x in inv:
            wavelen = 2 * math.pi / x
            if wavelen < high_wavelen:
                out.append(x)
            elif wavelen > low_wavelen:
                out.append(x / factor)
            else:
                smooth = (old_ctx / wavelen - low) / (high - low)
                out.append((1 - smooth) * x / factor + smooth * x)
        return out, 1.0
    if kind == "yarn":
        factor = float(s["factor"])
        old_ctx = float(s.get("original_max_position_embeddings") or cfg.max_position_embeddings)
        beta_fast = float(s.get("beta_fast") or 32)
        beta_slow = float(s.get("beta_slow") or 1)

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 0.1 * m * math.log(scale) + 1.0 if scale > 1 else 1.0

        mscale = s.get("attention_factor")
        if mscale is None:
            if s.get("mscale") and s.get("mscale_all_dim"):
                mscale = get_mscale(factor, float(s["mscale"])) / get_mscale(factor, float(s["mscale_all_dim"]))
            else:
                mscale = get_mscale(factor)

        def correction_dim(rot: float) -> float:
            return (dim * math.log(old_ctx / (rot * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if s.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        out = []
        for i, x in enumerate(inv):
            ramp = min(max((i - low) / (high - low), 0.0), 1.0)
            extrapolation = 1 - ramp
            out.append((x / factor) * (1 - extrapolation) + x * extrapolation)
        return out, float(mscale)
    raise UnsupportedModelError(f"rope scaling {kind!r} is not supported")
