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
DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2")
#: Sparse Mixture-of-Experts variants of that layout. ``m2r2_moe`` is ours: a Llama block whose MLP was
#: split into experts by ``m2r2 moefy`` (transformers has no class for it, so it must not claim to be llama).
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "olmoe", "m2r2_moe")
SUPPORTED_MODEL_TYPES = DENSE_MODEL_TYPES + MOE_MODEL_TYPES
#: How the router's scores become expert weights (see :meth:`m2r2.model.MoE.route`):
#: ``softmax_topk_renorm`` softmax over all experts, top-k, renormalised to sum 1 (Mixtral; Qwen2-MoE and
#: OLMoE with ``norm_topk_prob``); ``softmax_topk`` the same without renormalising (Qwen2-MoE / OLMoE
#: default); ``ones`` each selected expert counts fully (MoEfication: the experts partition a dense FFN, so
#: top-k = E reproduces it exactly).
ROUTER_WEIGHTS = ("softmax_topk_renorm", "softmax_topk", "ones")
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
    # Mixture of experts (num_experts = 0: dense). Sparse layers hold E experts of moe_intermediate_size
    # neurons each, top num_experts_per_tok per token, and optionally a sigmoid-gated shared expert.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    router_weights: str = "softmax_topk_renorm"
    shared_expert_intermediate_size: int = 0
    #: Qwen2-MoE scales its shared expert by sigmoid(gate(x)); MoEfied models add theirs ungated.
    shared_expert_gated: bool = True
    #: Indices of the sparse layers; None = every layer (when num_experts > 0).
    sparse_layers: list[int] | None = None
    # OLMoE attention: RMSNorm over the whole q and k projections before RoPE, and optional clipping.
    qk_norm: bool = False
    clip_qkv: float | None = None

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_kv_heads < 1:
            raise UnsupportedModelError(f"head counts must be positive, got {self.num_heads} / {self.num_kv_heads}")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise UnsupportedModelError(
                    f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts={self.num_experts}"
                )
            if self.moe_intermediate_size < 1:
                raise UnsupportedModelError("an MoE config needs moe_intermediate_size >= 1")
            if self.router_weights not in ROUTER_WEIGHTS:
                raise UnsupportedModelError(
                    f"router_weights {self.router_weights!r} is not one of {', '.join(ROUTER_WEIGHTS)}"
                )
            if self.sparse_layers is not None and any(not 0 <= i < self.num_layers for i in self.sparse_layers):
                raise UnsupportedModelError(f"sparse layers {self.sparse_layers} outside 0..{self.num_layers - 1}")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_sparse(self, layer: int) -> bool:
        """Whether block ``layer`` has a sparse MoE instead of a dense MLP."""
        return self.num_experts > 0 and (self.sparse_layers is None or layer in self.sparse_layers)

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
        if model_type in ("llama", "olmoe", "m2r2_moe") and d.get("attention_bias"):
            raise UnsupportedModelError(
                f"attention_bias=true (biased q/k/v/o projections) is not supported for {model_type}"
            )
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
        moe = _moe_fields(model_type, d)
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
            attention_bias=model_type == "qwen2" or (model_type == "qwen2_moe" and bool(d.get("qkv_bias", True))),
            sliding_window=int(window) if window else None,
            model_type=model_type,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **moe,
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


def _moe_fields(model_type: str, d: dict[str, Any]) -> dict[str, Any]:
    """The MoE part of :class:`ModelConfig` from an HF config dict, per architecture.

    Semantics follow transformers' modeling code: Mixtral renormalises its top-k softmax weights;
    Qwen2-MoE and OLMoE do so only with ``norm_topk_prob``; Qwen2-MoE makes layer i sparse when
    ``(i + 1) % decoder_sparse_step == 0`` and i is not in ``mlp_only_layers``, and adds a shared expert.
    """
    if model_type in DENSE_MODEL_TYPES:
        return {}
    n_layers = int(d["num_hidden_layers"])
    renorm = "softmax_topk_renorm" if d.get("norm_topk_prob") else "softmax_topk"
    if model_type == "mixtral":
        e, f, weights = int(d.get("num_local_experts", 8)), int(d["intermediate_size"]), "softmax_topk_renorm"
    elif model_type == "olmoe":
        e, f, weights = int(d.get("num_experts", 64)), int(d["intermediate_size"]), renorm
    elif model_type == "qwen2_moe":
        e, f, weights = int(d.get("num_experts", 60)), int(d.get("moe_intermediate_size", 1408)), renorm
    else:  # m2r2_moe: written by m2r2 moefy with explicit fields
        e, f, weights = int(d["num_experts"]), int(d["moe_intermediate_size"]), str(d.get("router_weights", "ones"))
    out: dict[str, Any] = {
        "num_experts": e,
        "num_experts_per_tok": int(d.get("num_experts_per_tok", 2)),
        "moe_intermediate_size": f,
        "router_weights": weights,
    }
    if model_type == "olmoe":
        out["qk_norm"] = True
        clip = d.get("clip_qkv")
        out["clip_qkv"] = float(clip) if clip is not None else None
    if model_type == "qwen2_moe":
        out["shared_expert_intermediate_size"] = int(d.get("shared_expert_intermediate_size") or 0)
        step = int(d.get("decoder_sparse_step") or 1)
        dense = {int(i) for i in d.get("mlp_only_layers") or []}
        sparse = [i for i in range(n_layers) if i not in dense and (i + 1) % step == 0]
        out["sparse_layers"] = None if len(sparse) == n_layers else sparse
    if model_type == "m2r2_moe":
        out["shared_expert_intermediate_size"] = int(d.get("shared_expert_intermediate_size") or 0)
        out["shared_expert_gated"] = bool(d.get("shared_expert_gated", False))
        if d.get("sparse_layers") is not None:
            out["sparse_layers"] = [int(i) for i in d["sparse_layers"]]
    return out


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
