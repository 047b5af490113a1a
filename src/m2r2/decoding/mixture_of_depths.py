"""Method ``mod``: Mixture-of-Depths-style block skipping with routers trained on the frozen model.

Each generated token runs block ``i`` only if its router says so (``g_i(x) >= threshold``, see
:mod:`m2r2.training.mixture_of_depths`); otherwise its residual passes the block unchanged. The knob is a
per-token threshold rather than MoD's per-sequence capacity, because capacity-based top-k routing
needs the whole sequence (non-causal) and we decode one token at a time; the MoD paper's own answer
for sampling is likewise a causal per-token decision.

K/V of skipped tokens, the faithful MoD choice: a token that skips block ``i`` writes no K/V there,
and later tokens mask its slot out at block ``i`` (a per-layer validity mask over the cache).
Computing its K/V anyway would cost the block's q/k/v projection (~1/6 of a block here) and
would no longer be MoD, where a skipped token takes no part in the block at all; the routers are
trained for this masking (their gate weights keys in the soft-routed attention).

The prompt is prefilled through every block (one parallel pass, where skipping saves little on
a bandwidth-bound CPU); only generated tokens are routed. ``threshold = 0`` runs every block with
vanilla's arithmetic and reproduces ``vanilla`` greedy token for token.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from m2r2 import weightfile
from m2r2.cache import KVCache
from m2r2.decoding import register
from m2r2.decoding.base import (
    GenerationConfig,
    GenerationResult,
    Sampler,
    StreamCallback,
    begin,
)
from m2r2.errors import SettingsError, WeightsError
from m2r2.model import Transformer

if TYPE_CHECKING:
    from m2r2.cache import Conversation
    from m2r2.decoding.base import Loaded

# --------------------------------------------------------------------------- routers

FORMAT = "m2r2-mod-routers"
VERSION = 1
ROUTERS = weightfile.Kind(
    FORMAT,
    "router",
    "an m2r2 Mixture-of-Depths router config",
    "`m2r2 train-mod`",
    "no Mixture-of-Depths routers ship for this base model; train some with `m2r2 train-mod` "
    "and pass --option routers=PATH",
)


@dataclass
class RouterConfig:
    num_layers: int
    hidden_size: int
    always_on: list[int] = field(default_factory=list)  # blocks without a router (always run)

    @classmethod
    def build(cls, num_layers: int, hidden_size: int, always_on: list[int] | None = None) -> RouterConfig:
        on = sorted({0, num_layers - 1} if always_on is None else set(always_on))
        if any(not 0 <= i < num_layers for i in on):
            raise SettingsError(f"always-on blocks must be in 0..{num_layers - 1}, got {on}")
        return cls(num_layers, hidden_size, on)

    @property
    def routed(self) -> list[int]:
        return [i for i in range(self.num_layers) if i not in self.always_on]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RouterConfig:
        return cls(int(d["num_layers"]), int(d["hidden_size"]), [int(i) for i in d.get("always_on", [])])


class Routers(nn.Module):
    """One linear ``d -> 1`` router per block (float32; rows of always-on blocks are unused)."""

    def __init__(self, cfg: RouterConfig, init_bias: float = 3.0) -> None:
        super().__init__()
        self.cfg = cfg
        # zero weights + positive bias: the untrained routed model runs every block with g ~ 0.95
        self.weight = nn.Parameter(torch.zeros(cfg.num_layers, cfg.hidden_size))
        self.bias = nn.Parameter(torch.full((cfg.num_layers,), float(init_bias)))
        self.eps = 1e-6

    def logit(self, x: Tensor, i: int) -> Tensor:
        """Router logit of block ``i`` for inputs ``x`` (``[..., d]``), float32 ``[...]``."""
        xn = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return xn @ self.weight[i] + self.bias[i]


# --------------------------------------------------------------------------- files


def save_routers(path: Path, routers: Routers, fingerprint: str, **info: Any) -> Path:
    """Weights (float32, they are tiny) then the JSON sidecar, both written atomically."""
    sd = {k: v.detach().float().contiguous() for k, v in routers.state_dict().items()}
    return weightfile.save(path, sd, ROUTERS, fingerprint, VERSION, routers.cfg.to_dict(), **info)


def load_routers(path: Path, model: Transformer, fingerprint: str) -> Routers:
    """Routers for ``model`` from a router file, after the fingerprint and checksum checks."""
    sd, meta = weightfile.load(path, ROUTERS, fingerprint)
    cfg = RouterConfig.from_dict(meta["config"])
    if (cfg.num_layers, cfg.hidden_size) != (model.cfg.num_layers, model.cfg.hidden_size):
        raise WeightsError(f"routers {Path(path).name} do not fit this model's {model.cfg.num_layers} layers")
    routers = Routers(cfg)
    expected = routers.state_dict()
    if set(sd) != set(expected) or any(sd[k].shape != expected[k].shape for k in sd):
        raise WeightsError(f"router weights {path} do not match their config {meta['config']}")
    routers.load_state_dict(sd)
    return routers.to(model.device).requires_grad_(False)


def bundled_routers(fingerprint: str) -> Path | None:
    """The routers shipped in ``m2r2/adapters/`` for the base model with this fingerprint, if any."""
    return weightfile.bundled(ROUTERS, fingerprint)


def load_default_routers(model: Transformer, fingerprint: str, path: Path | None = None) -> Routers:
    """Routers from ``path``, else the shipped ones for this base model; a clear error if none."""
    return load_routers(weightfile.given_or_shipped(path, ROUTERS, fingerprint), model, fingerprint)


# --------------------------------------------------------------------------- decoding

#: Default threshold of the shipped routers (see benchmarks/dynamic/MOD_NOTES.md).
DEFAULT_THRESHOLD = 0.5


def check_threshold(threshold: object) -> float:
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not math.isfinite(threshold):
        raise SettingsError(f"mod: threshold must be a number in [0, 1], got {threshold!r}")
    if not 0.0 <= threshold <= 1.0:
        raise SettingsError(f"mod: threshold must be in [0, 1] (0 = run every block), got {threshold}")
    return float(threshold)


class MixtureOfDepths:
    """Greedy/sampled decoding where each token runs only the blocks its routers pick."""

    name = "mod"

    def __init__(
        self,
        model: Transformer,
        routers: Routers,
        threshold: float,
        eos_ids: list[int],
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        self.model = model
        self.routers = routers
        self.threshold = check_threshold(threshold)
        self.eos_ids = eos_ids
        self.decode = decode
        self.routed = set(routers.cfg.routed)
        # g >= threshold  <=>  router logit >= logit(threshold): no sigmoid per block
        t = self.threshold
        self.cut = math.inf if t >= 1.0 else -math.inf if t <= 0.0 else math.log(t / (1.0 - t))
        self.holes: set[int] = set()  # blocks with a skipped slot in the current cache

    def step(self, tok: int, cache: KVCache, valid: Tensor) -> tuple[Tensor, int]:
        """Logits for one token at ``cache.length`` and the number of blocks it ran.

        ``valid[i, s]`` is False where slot ``s`` holds no K/V at block ``i`` (its token skipped it).
        """
        m, pos = self.model, cache.length
        x = m.embed_tokens(torch.tensor([[tok]], device=m.device))
        cos, sin = m.rope(pos, 1, x.dtype)
        causal = m.causal_mask(pos, 1, cache.max_len)
        ran = 0
        for i, blk in enumerate(m.layers):
            if self.threshold > 0 and i in self.routed and self.routers.logit(x, i) < self.cut:
                valid[i, pos] = False  # no K/V written at this block: masked out for later tokens
                self.holes.add(i)
                continue
            x = blk(x, cos, sin, cache, i, pos, causal & valid[i] if i in self.holes else causal)
            ran += 1
        cache.length = pos + 1
        return m.head(x), ran

    @torch.inference_mode()
    def generate(
        self,
        prompt: list[int],
        gen: GenerationConfig,
        stream: StreamCallback | None = None,
        session: Conversation | None = None,
    ) -> GenerationResult:
        m = self.model
        t0, stopper, cache, logits = begin(m, prompt, gen, self.eos_ids, self.decode)
        sampler = Sampler(gen, m.device)
        valid = torch.ones(m.cfg.num_layers, cache.max_len, dtype=torch.bool, device=m.device)
        self.holes = set()
        n_layers = m.cfg.num_layers
        layers_run, steps = [n_layers], 1  # the prefill's last position gives the first token
        while True:
            tok = sampler(logits[0, -1])
            stopper.emit([tok], stream)
            if stopper.done:
                break
            logits, ran = self.step(tok, cache, valid)
            layers_run.append(ran)
            steps += 1
        return stopper.result(
            t0,
            prompt,
            stats={
                "forward_passes": steps,
                "layers_per_token": sum(layers_run) / len(layers_run),
                "threshold": self.threshold,
            },
        )


@register("mod", "Mixture-of-Depths baseline: trained per-block routers let each token skip blocks (lossy)")
def _mod(engine: Loaded, *, threshold: float = DEFAULT_THRESHOLD, routers: str | None = None) -> MixtureOfDepths:
    threshold = check_threshold(threshold)
    r = load_default_routers(engine.model, engine.fingerprint, Path(routers) if routers else None)
    return MixtureOfDepths(engine.model, r, threshold, engine.tokenizer.eos_ids, engine.tokenizer.decode)
