"""A compact Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2) over a preallocated KV cache.

Written in the style of gpt-fast: fused q/k/v and gate/up projections (fewer, larger matmuls are
what a memory-bound CPU or GPU decode step wants), RoPE tables computed once, and a forward that
takes any number of new tokens at any cache position, which is what prefill, decoding and
multi-token verification all need.

Each block exposes its pieces (:meth:`Attention.qkv`, :func:`attend`, :meth:`Attention.out`,
:meth:`MLP.forward`) and accepts low-rank deltas through ``lora`` so that the multi-rate fast
stream (``m2r2.multirate``) can reuse the same weights and code without this file knowing about it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from m2r2.cache import KVCache
from m2r2.config import ModelConfig, rope_inv_freq

#: Optional low-rank deltas keyed by projection name ("qkv", "o", "gate_up", "down"): each maps
#: the projection's input to a delta added to its output.
Lora = Mapping[str, Callable[[Tensor], Tensor]]


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32 and cast back before the weight, as HF Llama does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:  # reference mode: HF's exact order of operations
            return self.weight * F.rms_norm(x, (x.shape[-1],), None, self.eps)
        # low precision: one fused kernel (it accumulates in float32 internally)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` (``[B, H, T, D]``) by position tables ``cos`` and sign-folded ``sin`` (``[T, D]``).

    ``sin`` carries the minus sign of rotate-half in its first half, so the rotation is
    ``x * cos + roll(x, D/2) * sin``: the same numbers as the textbook form with fewer ops.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


#: Up to this many query rows, attention runs each row as its own batch item (see :func:`attend`).
ROW_INVARIANT_MAX_ROWS = 32


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """Scaled dot-product attention with grouped-query heads; ``mask`` is boolean (True = attend).

    A pass over a few rows (a speculative verify block, a lookahead step) must give each row the
    bits a one-token decoding step would give it, or greedy speculative decoding stops being
    lossless: the fused kernel's inner products differ in their last bits between 1 and k query
    rows. So up to :data:`ROW_INVARIANT_MAX_ROWS` rows are folded into the batch dimension and
    every row runs the same one-row kernel as decoding (keys are broadcast, not copied, for one
    sequence). Longer passes (prefill, training) use the kernel as is.
    """
    b, h, t, d = q.shape
    gqa = k.shape[1] != h
    if mask is None or t > ROW_INVARIANT_MAX_ROWS:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    s = k.shape[2]
    qf = q.transpose(1, 2).reshape(b * t, h, 1, d)
    kf = k.unsqueeze(1).expand(b, t, *k.shape[1:]).reshape(b * t, *k.shape[1:])
    vf = v.unsqueeze(1).expand(b, t, *v.shape[1:]).reshape(b * t, *v.shape[1:])
    mf = mask.expand(b, t, s).reshape(b * t, 1, 1, s) if mask.dim() <= 3 else mask.reshape(b * t, 1, 1, s)
    out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mf, enable_gqa=gqa)
    return out.reshape(b, t, h, d).transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv * self.head_dim
        self.wqkv = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.wo = nn.Linear(self.q_size, cfg.hidden_size, bias=False)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor, lora: Lora | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Project normed ``x`` (``[B, T, d]``) to rotated q and k and plain v, ``[B, heads, T, D]``."""
        y = self.wqkv(x)
        if lora is not None and "qkv" in lora:
            y = y + lora["qkv"](x)
        b, t, _ = x.shape
        y = y.view(b, t, self.n_heads + 2 * self.n_kv, self.head_dim).transpose(1, 2)
        # q and k share one rotation call; v is the remaining heads.
        qk = apply_rope(y[:, : self.n_heads + self.n_kv], cos, sin)
        return qk[:, : self.n_heads], qk[:, self.n_heads :], y[:, self.n_heads + self.n_kv :]

    def out(self, o: Tensor, lora: Lora | None = None) -> Tensor:
        """Merge heads of ``o`` (``[B, H, T, D]``) and apply the output projection."""
        b, _, t, _ = o.shape
        o = o.transpose(1, 2).reshape(b, t, self.q_size)
        y = self.wo(o)
        if lora is not None and "o" in lora:
            y = y + lora["o"](o)
        return y


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w13 = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, lora: Lora | None = None) -> Tensor:
        y = self.w13(x)
        if lora is not None and "gate_up" in lora:
            y = y + lora["gate_up"](x)
        gate, up = y.chunk(2, dim=-1)
        h = F.silu(gate) * up
        out = self.w2(h)
        if lora is not None and "down" in lora:
            out = out + lora["down"](h)
        return out


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, layer: int, pos: int, mask: Tensor
    ) -> Tensor:
        """Slow-stream step: write this block's K/V at ``pos`` and attend over the first
        ``mask.shape[-1]`` cache slots under ``mask``."""
        q, k, v = self.attn.qkv(self.attn_norm(x), cos, sin)
        cache.write(layer, pos, k, v)
        keys, values = cache.view(layer, mask.shape[-1])
        a = x + self.attn.out(attend(q, keys, values, mask))
        return a + self.mlp(self.mlp_norm(a))


class Transformer(nn.Module):
    """Embedding, ``num_layers`` blocks, final norm and LM head (tied or untied)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.reset_rope()

    def reset_rope(self) -> None:
        """(Re)compute the RoPE tables in float32, e.g. after building the model on the meta device.

        Computed in float32 and cast once to the weights' dtype, which is what transformers does
        per forward, so reference-mode outputs match it exactly. Call again after a dtype change.
        """
        cfg = self.cfg
        device = self.embed.weight.device
        if device.type == "meta":
            device = torch.device("cpu")
        inv, scale = rope_inv_freq(cfg)
        inv_t = torch.tensor(inv, dtype=torch.float32, device=device)
        t = torch.arange(cfg.max_position_embeddings, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_t)
        sin = freqs.sin() * scale
        dtype = self.embed.weight.dtype
        self.rope_cos = (freqs.cos() * scale).repeat(1, 2).to(dtype)
        self.rope_sin = torch.cat((-sin, sin), dim=-1).to(dtype)  # sign of rotate_half folded in

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        return KVCache(self.cfg, max_len, batch, dtype=self.dtype, device=self.device)

    def rope(self, pos: int, length: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        cos, sin = self.rope_cos[pos : pos + length], self.rope_sin[pos : pos + length]
        if cos.dtype != dtype:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos, sin

    def causal_mask(self, pos: int, t: int, kv_len: int) -> Tensor:
        """Mask ``[t, kv_len]`` for queries at ``pos..pos+t-1`` over cache slots ``0..kv_len-1``.

        Attention always spans the same ``kv_len`` (the cache capacity) whatever ``t`` is: the
        attention kernel's reductions then see identical lengths for a one-token decoding step
        and for a k-token verification pass, so each row gets bit-identical results. With exact
        lengths (``pos + t``) a bf16 verify pass differs from decoding in the last bits, which
        flips near-tied argmaxes and breaks lossless speculative decoding.
        """
        q_pos = torch.arange(pos, pos + t, device=self.device)[:, None]
        k_pos = torch.arange(kv_len, device=self.device)[None, :]
        mask = k_pos <= q_pos
        if self.cfg.sliding_window is not None:
            mask &= k_pos > q_pos - self.cfg.sliding_window
        return mask

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        return self.embed(tokens)

    def run_layers(
        self,
        x: Tensor,
        cache: KVCache,
        pos: int,
        hidden: list[Tensor] | None = None,
        stop: int | None = None,
        positions: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> Tensor:
        """Run blocks ``0..stop-1`` on embeddings ``x`` written at cache slots ``pos..``.

        Each block's output is appended to ``hidden`` when given. By default token t sits at
        position ``pos + t`` under a causal mask; tree and Jacobi-style verification passes
        instead give explicit RoPE ``positions`` (``[T]``) and a boolean ``mask``
        (``[T, pos + T]``, True = attend) over the cache slots.
        """
        t = x.shape[1]
        kv_len = cache.max_len
        if positions is None:
            cos, sin = self.rope(pos, t, x.dtype)
        else:
            cos, sin = self.rope_cos[positions].to(x.dtype), self.rope_sin[positions].to(x.dtype)
            if mask is None:
                raise ValueError("explicit positions need an explicit mask")
        if mask is None:
            mask = self.causal_mask(pos, t, kv_len)
        elif mask.shape[-1] < kv_len:  # pad a custom mask to the cache capacity (see causal_mask)
            mask = torch.cat([mask, mask.new_zeros(t, kv_len - mask.shape[-1])], dim=-1)
        for i, layer in enumerate(self.layers[:stop]):
            x = layer(x, cos, sin, cache, i, pos, mask)
            if hidden is not None:
                hidden.append(x)
        if stop is None or stop >= len(self.layers):
            cache.length = pos + t
        return x

    def head(self, h: Tensor) -> Tensor:
        """Final norm and LM head; logits are returned in float32 for exact argmax and sampling."""
        return self.lm_head(self.norm(h)).float()

    def forward(
        self,
        tokens: Tensor,
        cache: KVCache,
        pos: int | None = None,
        last_only: bool = False,
        positions: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> Tensor:
        """Logits for ``tokens`` (``[B, T]``) appended at ``pos`` (default: the cache length)."""
        pos = cache.length if pos is None else pos
        h = self.run_layers(self.embed_tokens(tokens), cache, pos, positions=positions, mask=mask)
        if last_only:
            h = h[:, -1:]
        return self.head(h)


def hf_state_to_ours(sd: Mapping[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Map an HF Llama/Mistral/Qwen2 state dict to our fused layout (q|k|v and gate|up concatenated)."""
    out: dict[str, Tensor] = {"embed.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"]}
    # A tied head is the same Parameter as the embedding; load_state_dict still wants both keys.
    out["lm_head.weight"] = out["embed.weight"] if cfg.tie_word_embeddings else sd["lm_head.weight"]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out[f"layers.{i}.attn.wqkv.weight"] = torch.cat(
            [sd[a + "q_proj.weight"], sd[a + "k_proj.weight"], sd[a + "v_proj.weight"]]
        )
        if cfg.attention_bias:
            out[f"layers.{i}.attn.wqkv.bias"] = torch.cat(
                [sd[a + "q_proj.bias"], sd[a + "k_proj.bias"], sd[a + "v_proj.bias"]]
            )
        out[f"layers.{i}.attn.wo.weight"] = sd[a + "o_proj.weight"]
        out[f"layers.{i}.mlp.w13.weight"] = torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])
        out[f"layers.{i}.mlp.w2.weight"] = sd[p + "mlp.down_proj.weight"]
        out[f"layers.{i}.attn_norm.weight"] = sd[p + "input_layernorm.weight"]
        out[f"layers.{i}.mlp_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
    return out


class PackedLinear(nn.Module):
    """A frozen linear layer whose bf16 weight is pre-packed for oneDNN (AMX / AVX-512 on x86 CPUs).

    Measured on the project's CPU (3072x576, bf16): 0.135 ms at 1 row vs 0.22 ms for ``F.linear``,
    and nearly flat up to 16 rows (0.16 ms), which is what multi-token verification passes want.
    Row results do not depend on how many rows are batched, so a verify pass sees the same numbers
    as a one-token step.
    """

    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.weight = lin.weight  # kept for readers (tied heads, adapters' shapes); never used here
        self.bias = lin.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), batch_size=1)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), self.packed, self.bias, "none", [], "")
        return y.view(*shape[:-1], y.shape[-1])


class Int8Linear(nn.Module):
    """Weight-only int8 linear layer (symmetric, one scale per output channel), bf16 activations.

    Halves the bytes a memory-bound decoding step reads compared with bf16, at a small accuracy
    cost (it is a different model numerically: outputs are compared against bf16 in BENCHMARKS.md).
    Its cost grows faster with the number of rows than oneDNN's bf16 kernel, so it suits plain
    decoding more than multi-token verification.
    """

    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        w = lin.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_min(1e-8) / 127.0
        self.weight = lin.weight
        self.bias = lin.bias
        self.qweight = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        self.scales = scale.to(lin.weight.dtype)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shape[-1]), self.qweight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], y.shape[-1])


KERNELS = ("auto", "plain", "mkldnn", "int8")


def mkldnn_usable(model: Transformer) -> bool:
    return (
        model.device.type == "cpu"
        and model.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def use_kernels(model: Transformer, kernel: str = "auto") -> str:
    """Swap the model's linear layers for faster frozen kernels; returns the kernel used.

    ``plain`` keeps ``nn.Linear`` (needed for training, and the reference mode); ``auto`` picks
    ``mkldnn`` for bf16 on CPU when available.
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; choose from {', '.join(KERNELS)}")
    if kernel == "auto":
        kernel = "mkldnn" if mkldnn_usable(model) else "plain"
    if kernel == "mkldnn" and not mkldnn_usable(model):
        raise ValueError("the mkldnn kernel needs bf16 weights on a CPU with oneDNN")
    if kernel == "int8" and (model.dtype != torch.bfloat16 or model.device.type != "cpu"):
        raise ValueError("the int8 kernel needs bf16 activations on a CPU")
    wrap = {"mkldnn": PackedLinear, "int8": Int8Linear}.get(kernel)
    if wrap is not None:
        for block in model.layers:
            block.attn.wqkv = wrap(block.attn.wqkv)
            block.attn.wo = wrap(block.attn.wo)
            block.mlp.w13 = wrap(block.mlp.w13)
            block.mlp.w2 = wrap(block.mlp.w2)
        model.lm_head = wrap(model.lm_head)
    return kernel
