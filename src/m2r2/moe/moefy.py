"""MoEfication: turn a dense Llama-family model into a sparse MoE with real routing (Zhang et al., 2022).

No real MoE checkpoint can be downloaded here, so the MoE measurements run on the bundled SmolLM2
split into experts. Per layer:

1. **Split.** The FFN's ``F`` SwiGLU neurons are partitioned into ``E`` equal groups by balanced
   k-means. Two neuron features are available: ``coact`` (default) clusters neurons by their
   contribution pattern over tokens (``|h_i| * ||w2[:, i]||`` on a sample of activations, so neurons
   that matter for the same tokens land in the same expert), ``weights`` by their gate|up weight
   vectors (the paper's parameter split). ``benchmarks/moe/MOEFY_NOTES.md`` compares the two.
   Optionally the ``shared`` neurons with the largest mean output mass are set apart first as an
   always-on, ungated shared expert (measured: much better quality at the same routed sparsity).
   Expert e keeps its neurons' gate, up and down weights, so shared + all experts *is* the dense
   FFN: with ``top_k = E`` the MoE reproduces the dense model (tested).
2. **Route.** A linear router ``d -> E`` (no bias) on the FFN's normed input is fitted to the
   distribution of *output mass* ``||w2_e h_e||`` over experts, measured on activations of the
   training prompts and answers. Selected experts get weight 1 (``router_weights = "ones"``): an
   expert's output is exactly its share of the dense FFN, so any reweighting would only add error.

The result is an ordinary model directory (``model_type = "m2r2_moe"``, experts stored fused as
``mlp.experts.gate_up_proj [E, 2F/E, d]`` / ``mlp.experts.down_proj [E, d, F/E]``) that
:func:`m2r2.loading.load_model` and ``Engine`` load like any other.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor

from m2r2.errors import InputError, SettingsError, UnsupportedModelError
from m2r2.files import atomic_dir
from m2r2.loading import (
    FINGERPRINT_FILE,
    _write_fingerprint,
    cache_root,
    file_hash,
    fingerprint,
    load_model,
    read_state_dict,
    resolve_model,
)
from m2r2.model import MLP, Transformer
from m2r2.paths import DEFAULT_ANSWERS, shipped_conversations

#: Bump when the algorithm changes: it is part of the cache key of built models.
MOEFY_VERSION = 1
METHODS = ("coact", "weights")
#: Distilled answers of the bundled model to the training prompts (``m2r2 distill-data``).
DEFAULT_DATA = DEFAULT_ANSWERS
#: The setting chosen by measured quality (see benchmarks/moe/MOEFY_NOTES.md): 16 routed experts of 64
#: neurons, 8 per token, plus 512 always-on neurons, for SmolLM2's 1536-neuron FFNs (1024 of 1536 active).
DEFAULT_EXPERTS = 16
DEFAULT_TOP_K = 8
DEFAULT_SHARED = 512


@dataclass
class MoefySettings:
    experts: int = DEFAULT_EXPERTS
    top_k: int = DEFAULT_TOP_K
    method: str = "coact"
    shared: int = 0  # neurons kept in an always-on shared expert (the highest mean output mass)
    sequences: int = 96  # training sequences whose activations are collected
    max_len: int = 512  # tokens per sequence at most
    tokens_per_layer: int = 8192  # activation rows kept per layer (uniform sample)
    kmeans_iters: int = 25
    router_steps: int = 300
    seed: int = 0

    def check(self, intermediate_size: int) -> None:
        if self.method not in METHODS:
            raise SettingsError(f"unknown MoEfication method {self.method!r}; choose from {', '.join(METHODS)}")
        if not 0 <= self.shared < intermediate_size:
            raise SettingsError(f"--shared {self.shared} must be in 0..{intermediate_size - 1}")
        routed = intermediate_size - self.shared
        if self.experts < 2 or routed % self.experts:
            raise SettingsError(
                f"--experts {self.experts} must be >= 2 and divide the routed FFN width {routed}"
                f" ({intermediate_size} - {self.shared} shared)"
            )
        if not 1 <= self.top_k <= self.experts:
            raise SettingsError(f"--top-k {self.top_k} must be in 1..{self.experts}")


# --------------------------------------------------------------------------- activations


@torch.no_grad()
def collect_activations(
    model: Transformer, sequences: list[list[int]], rows: int, seed: int
) -> list[tuple[Tensor, Tensor]]:
    """Per layer: normed FFN inputs ``x [N, d]`` (float32) and activations ``h = silu(gate) * up [N, F]`` (float16).

    ``N <= rows`` token positions sampled uniformly (same positions for every layer) from all sequences.
    """
    total = sum(len(s) for s in sequences)
    g = torch.Generator().manual_seed(seed)
    keep = torch.zeros(total, dtype=torch.bool)
    keep[torch.randperm(total, generator=g)[: min(rows, total)]] = True
    xs: list[list[Tensor]] = [[] for _ in model.layers]
    hooks = []
    sel: list[Tensor] = []
    for i, block in enumerate(model.layers):
        if not isinstance(block.mlp, MLP):
            raise UnsupportedModelError("MoEfication needs a dense model")

        def hook(_mod: Any, args: tuple[Tensor, ...], i: int = i) -> None:
            xs[i].append(args[0][0][sel[0]].float())

        hooks.append(block.mlp.register_forward_pre_hook(hook))
    try:
        start = 0
        for seq in sequences:
            sel[:] = [keep[start : start + len(seq)]]
            start += len(seq)
            if sel[0].any():
                model(torch.tensor([seq]), model.new_cache(len(seq)), 0)
    finally:
        for h in hooks:
            h.remove()
    out = []
    for block, parts in zip(model.layers, xs, strict=True):
        x = torch.cat(parts)
        gate, up = F.linear(x, block.mlp.w13.weight.float()).chunk(2, dim=-1)
        out.append((x, (F.silu(gate) * up).half()))  # half: 30 layers x 16k rows x 1536 neurons
    return out


# --------------------------------------------------------------------------- split


def balanced_kmeans(feats: Tensor, k: int, iters: int, seed: int) -> Tensor:
    """Labels ``[n]`` putting exactly ``n / k`` rows of ``feats`` in each of ``k`` clusters.

    Lloyd iterations whose assignment step is capacity-constrained: rows are placed in order of how
    much they would lose by not getting their nearest centroid (largest regret first), each into
    its nearest cluster that still has room.
    """
    n = feats.shape[0]
    cap = n // k
    g = torch.Generator().manual_seed(seed)
    cent = feats[torch.randperm(n, generator=g)[:k]].clone()
    labels = torch.zeros(n, dtype=torch.long)
    for _ in range(iters):
        dist = torch.cdist(feats, cent)
        two = dist.topk(2, dim=1, largest=False).values
        order = torch.argsort(two[:, 1] - two[:, 0], descending=True).tolist()
        ranked = dist.argsort(dim=1).tolist()
        room = [cap] * k
        new = torch.empty(n, dtype=torch.long)
        for r in order:
            c = next(c for c in ranked[r] if room[c])
            room[c] -= 1
            new[r] = c
        if torch.equal(new, labels):
            break
        labels = new
        for c in range(k):
            cent[c] = feats[labels == c].mean(dim=0)
    return labels


def neuron_features(method: str, mlp: MLP, h: Tensor, max_tokens: int = 4096) -> Tensor:
    """Unit-norm features of each neuron for clustering (see the module docstring)."""
    if method == "weights":
        w = mlp.w13.weight.float()
        f = w.shape[0] // 2
        feats = torch.cat([w[:f], w[f:]], dim=1)
    else:
        down = mlp.w2.weight.float().norm(dim=0)  # [F]
        feats = (h[:max_tokens].abs() * down).T  # [F, tokens]
    return F.normalize(feats, dim=1)


def expert_mass(h: Tensor, w2: Tensor, groups: list[Tensor]) -> Tensor:
    """``[N, E]``: norm of each expert's output ``w2_e h_e`` per token (what dropping it would lose)."""
    return torch.stack([F.linear(h[:, g], w2[:, g]).norm(dim=-1) for g in groups], dim=1)


# --------------------------------------------------------------------------- route


def fit_router(x: Tensor, mass: Tensor, steps: int, seed: int) -> Tensor:
    """Router weight ``[E, d]``: softmax(x W^T) fitted (cross-entropy) to the normalised expert mass.

    The mass distribution rather than a top-k label set is the target, so one router ranks experts
    for any top-k.
    """
    torch.manual_seed(seed)
    target = mass / mass.sum(dim=-1, keepdim=True).clamp_min(1e-12)
    w = torch.zeros(mass.shape[1], x.shape[1], requires_grad=True)
    opt = torch.optim.Adam([w], lr=1e-2)
    for _ in range(steps):
        loss = -(target * F.log_softmax(x @ w.T, dim=-1)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return w.detach()


def coverage(
    x: Tensor, h: Tensor, w2: Tensor, groups: list[Tensor], shared: Tensor, router: Tensor | None, k: int
) -> float:
    """Mean relative error ``||y_topk - y|| / ||y||`` of the FFN output with k experts (oracle if router None)."""
    outs = torch.stack([F.linear(h[:, g], w2[:, g]) for g in groups], dim=1)  # [N, E, d]
    always = F.linear(h[:, shared], w2[:, shared])
    full = outs.sum(1) + always
    score = outs.norm(dim=-1) if router is None else x @ router.T
    top = score.topk(k, dim=-1).indices
    part = outs.gather(1, top[..., None].expand(-1, -1, outs.shape[-1])).sum(1) + always
    return float(((part - full).norm(dim=-1) / full.norm(dim=-1).clamp_min(1e-9)).mean())


# --------------------------------------------------------------------------- build


def calibration_data(data: Path, fallback: tuple[Path | None, ...] | None = None) -> Path:
    """``data`` if it exists, else the first existing ``fallback`` (default: the project's shipped
    training conversations), so ``bench --suite moe`` runs on a fresh clone without ``distill-data``."""
    for path in (Path(data), *(fallback if fallback is not None else (shipped_conversations(),))):
        if path is not None and path.is_file():
            return path
    raise InputError(f"MoEfication needs distilled answers at {data}: run `m2r2 distill-data` first")


def read_sequences(data: Path, limit: int, max_len: int, model_dir: Path | None = None) -> list[list[int]]:
    """Token ids of the first ``limit`` records: distilled answers (prompt + answer ids), or chat
    conversations (``{"messages": [...]}``, tokenized with ``model_dir``'s chat template)."""
    from m2r2.paths import load_distilled

    with open(data, encoding="utf-8") as f:
        rows = [json.loads(line) for line, _ in zip(filter(str.strip, f), range(limit), strict=False)]
    if rows and "messages" in rows[0] and model_dir is not None:
        from m2r2.tokenizer import ChatTokenizer

        tok = ChatTokenizer(model_dir)
        seqs = [tok.encode_conversation(r["messages"])[:max_len] for r in rows]
    else:
        seqs = [(r["prompt_ids"] + r["answer_ids"])[:max_len] for r in load_distilled(data)[:limit]]
    if not seqs:
        raise InputError(f"{data} holds no sequences")
    return seqs


def moefy(
    src_dir: Path,
    out_dir: Path,
    sequences: list[list[int]],
    settings: MoefySettings | None = None,
    quiet: bool = True,
    extra_config: dict[str, Any] | None = None,
    acts: list[tuple[Tensor, Tensor]] | None = None,
) -> dict[str, Any]:
    """Write the MoEfied version of the dense model in ``src_dir`` to ``out_dir``; returns fit statistics.

    ``acts`` reuses activations from :func:`collect_activations` (for comparing settings). The
    directory is written into a temporary sibling and renamed, so an interrupted run leaves no half model.
    """
    s = settings or MoefySettings()
    loaded = load_model(src_dir, torch.float32, kernel="plain")
    model = loaded.model
    cfg = model.cfg
    if cfg.is_moe or cfg.model_type not in ("llama", "mistral", "qwen2"):
        raise UnsupportedModelError(f"{src_dir} is not a dense Llama-family model")
    s.check(cfg.intermediate_size)
    if acts is None:
        acts = collect_activations(model, sequences, s.tokens_per_layer, s.seed)
    hf = read_state_dict(src_dir)
    n_val = max(1, len(acts[0][0]) // 8)  # held-out rows for the fit statistics
    stats: dict[str, Any] = {"layers": []}
    fe = (cfg.intermediate_size - s.shared) // s.experts
    for i, (block, (x, h)) in enumerate(zip(model.layers, acts, strict=True)):
        mlp = block.mlp
        assert isinstance(mlp, MLP)
        h = h.float()
        w2 = mlp.w2.weight.float()
        # the always-on neurons: largest mean output mass |h_i| * ||w2[:, i]||
        order = torch.argsort((h[n_val:].abs().mean(0) * w2.norm(dim=0)), descending=True)
        shared, rest = order[: s.shared].sort().values, order[s.shared :].sort().values
        feats = neuron_features(s.method, mlp, h[n_val:])[rest]
        labels = balanced_kmeans(feats, s.experts, s.kmeans_iters, s.seed + i)
        groups = [rest[labels == e] for e in range(s.experts)]
        router = fit_router(x[n_val:], expert_mass(h[n_val:], w2, groups), s.router_steps, s.seed + i)
        xv, hv = x[:n_val], h[:n_val]
        stats["layers"].append(
            {
                "oracle_err": coverage(xv, hv, w2, groups, shared, None, s.top_k),
                "router_err": coverage(xv, hv, w2, groups, shared, router, s.top_k),
            }
        )
        p = f"model.layers.{i}.mlp."
        gate, up, down = hf.pop(p + "gate_proj.weight"), hf.pop(p + "up_proj.weight"), hf.pop(p + "down_proj.weight")
        hf[p + "gate.weight"] = router.to(gate.dtype)
        hf[p + "experts.gate_up_proj"] = torch.stack([torch.cat([gate[g], up[g]]) for g in groups])
        hf[p + "experts.down_proj"] = torch.stack([down[:, g] for g in groups])
        if s.shared:
            hf[p + "shared_expert.gate_proj.weight"] = gate[shared]
            hf[p + "shared_expert.up_proj.weight"] = up[shared]
            hf[p + "shared_expert.down_proj.weight"] = down[:, shared]
        if not quiet:
            st = stats["layers"][-1]
            print(
                f"moefy: layer {i}: top-{s.top_k} rel. error oracle {st['oracle_err']:.3f} "
                f"router {st['router_err']:.3f}",
                file=sys.stderr,
                flush=True,
            )
    for key in ("oracle_err", "router_err"):
        stats[key] = sum(st[key] for st in stats["layers"]) / len(stats["layers"])
    hf_cfg = json.loads((src_dir / "config.json").read_text())
    hf_cfg.update(
        model_type="m2r2_moe",
        architectures=["M2R2MoeForCausalLM"],
        num_experts=s.experts,
        num_experts_per_tok=s.top_k,
        moe_intermediate_size=fe,
        router_weights="ones",
        shared_expert_intermediate_size=s.shared,
        shared_expert_gated=False,
        m2r2_moefy={
            "version": MOEFY_VERSION,
            "source_model_type": cfg.model_type,
            "source_fingerprint": loaded.fingerprint,
            "settings": asdict(s),
            "fit": {"oracle_err": stats["oracle_err"], "router_err": stats["router_err"]},
            **(extra_config or {}),
        },
    )
    with atomic_dir(out_dir) as tmp:
        for f in src_dir.iterdir():  # tokenizer, chat template, generation config
            if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", FINGERPRINT_FILE):
                shutil.copy(f, tmp / f.name)
        save_file({k: v.contiguous() for k, v in hf.items()}, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2))
        _write_fingerprint(tmp, source=f"moefy of {src_dir} ({loaded.fingerprint})", checksums=True)
    return stats


def default_name(src_fingerprint: str, data_hash: str, s: MoefySettings) -> str:
    """Deterministic directory name: experts, top-k, method and a hash of source, data and settings."""
    key = json.dumps({"v": MOEFY_VERSION, "src": src_fingerprint, "data": data_hash, **asdict(s)}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    shared = f"-s{s.shared}" if s.shared else ""
    return f"smollm2-135m-moe-e{s.experts}-k{s.top_k}{shared}-{s.method}-{digest}"


def moefy_default(
    experts: int = DEFAULT_EXPERTS,
    top_k: int = DEFAULT_TOP_K,
    method: str = "coact",
    shared: int = DEFAULT_SHARED,
    data: Path = DEFAULT_DATA,
    model: str | Path | None = None,
    out: Path | None = None,
    quiet: bool = True,
) -> Path:
    """The MoEfied bundled SmolLM2 (or ``model``) in ``$M2R2_CACHE/models/<name>``, built once."""
    src = resolve_model(model, quiet=quiet)
    s = MoefySettings(experts=experts, top_k=top_k, method=method, shared=shared)
    data = calibration_data(Path(data))
    target = out or cache_root() / "models" / default_name(fingerprint(src), file_hash(data)[:16], s)
    if (target / FINGERPRINT_FILE).is_file() and (target / "config.json").is_file():
        return target
    if not quiet:
        print(f"m2r2: MoEfying {src.name} into {target} (E={experts}, top-k={top_k}, {method}) ...", file=sys.stderr)
    moefy(
        src, target, read_sequences(data, s.sequences, s.max_len, src), s, quiet=quiet, extra_config={"data": str(data)}
    )
    return target
