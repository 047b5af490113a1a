"""Lossless self-speculative decoding: a drafter proposes, one slow pass verifies, the cache rolls back.

The loop is drafter-agnostic: ``m2r2`` drafts with the M2R2 fast stream (trained accelerator
adapters over the shared slow KV cache), ``early-exit-spec`` with the same layers and no adapters
(plain early exit), which is the ablation that shows what the adapters buy; the peers ``deed``
(:mod:`m2r2.decoding.deed`) and ``two-model`` (:mod:`m2r2.decoding.two_model`) are drafters of
this same loop, so every chain method is verified by exactly the same code.

Invariants the tests check: greedy output is token-for-token the plain greedy output (a draft is
kept only where it equals the slow model's argmax, and the slow model always supplies the next
token), and with sampling the output follows the target distribution exactly (speculative
sampling: accept a draft with probability ``min(1, p/q)``, else resample from ``max(0, p - q)``).

Draft length adapts per round: drafting stops when ARLA (or the draft's own confidence) says the
next draft is unlikely to be accepted, and the cap is the draft length that maximises expected
tokens per unit time given the measured cost of a draft step and of a verify pass for k tokens and
the running acceptance rate.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from m2r2.cache import KVCache
from m2r2.decoding import register
from m2r2.decoding.base import (
    CACHE_SLACK,
    GenerationConfig,
    GenerationResult,
    Sampler,
    Stopper,
    StreamCallback,
    begin,
    warp_probs,
)
from m2r2.decoding.costs import CostModel, cached_costs, cost_cache_path, measure_costs
from m2r2.decoding.lookup import DEFAULT_LOOKUP
from m2r2.decoding.tree import SeededDrafter, TreeSpeculative, build_tree_speculative
from m2r2.errors import SettingsError
from m2r2.kernels import argmax_rows
from m2r2.model import ROW_INVARIANT_MAX_ROWS, Transformer
from m2r2.multirate.fast import DraftBlock, FastConfig, FastStream

if TYPE_CHECKING:
    from m2r2.cache import Conversation
    from m2r2.decoding.base import Loaded


class Drafter(Protocol):
    """Proposes tokens after the verified prefix; reads the slow cache, never changes verified entries."""

    #: base layers run per draft step (for the compute statistics)
    layers_per_step: int

    def start(self, verified_len: int) -> None:
        """Begin a new draft block right after ``verified_len`` verified positions."""

    def step(self, token: int) -> tuple[Tensor, float | None]:
        """Feed the next token of the block; return draft logits (``[V]`` float32) for the token after
        it and the probability that this draft will be accepted (None if the drafter has no estimate)."""

    def observe(self, tokens: list[int]) -> None:
        """``tokens`` just became verified, in order (the prompt, then each round's root token and
        accepted drafts). Drafters that read the slow cache ignore it; a separate draft model keeps
        its own KV cache in step with it."""


class SelfSpeculative:
    """Draft with a :class:`Drafter`, verify with the slow model, roll the KV cache back."""

    def __init__(
        self,
        name: str,
        model: Transformer,
        make_drafter: Callable[[object], Drafter],
        eos_ids: list[int],
        decode: Callable[[list[int]], str] | None = None,
        max_draft: int = 8,
        stop_below: float = 0.0,
        costs: CostModel | None = None,
        prior_accept: float = 0.5,
    ) -> None:
        # a verify pass holds max_draft + 1 rows; beyond ROW_INVARIANT_MAX_ROWS it is not bit-exact
        limit = min(CACHE_SLACK, ROW_INVARIANT_MAX_ROWS) - 1
        if not 1 <= max_draft <= limit:
            raise SettingsError(f"max_draft must be in 1..{limit}, got {max_draft}")
        if not 0.0 <= stop_below < 1.0:
            raise SettingsError(f"stop_below must be in [0, 1), got {stop_below}")
        self.name = name
        self.model = model
        self.make_drafter = make_drafter
        self.eos_ids = eos_ids
        self.decode = decode
        self.max_draft = max_draft
        self.stop_below = stop_below
        self.costs = costs
        self.prior_accept = prior_accept
        self.last_cache: KVCache | None = None  # the last generation's cache, for inspection and tests

    @torch.inference_mode()
    def generate(
        self,
        prompt: list[int],
        gen: GenerationConfig,
        stream: StreamCallback | None = None,
        session: Conversation | None = None,
    ) -> GenerationResult:
        model = self.model
        t0, stopper, cache, logits = begin(model, prompt, gen, self.eos_ids, self.decode, session=session)
        sampler = Sampler(gen, model.device)
        self.last_cache = cache
        drafter = self.make_drafter(cache)
        drafter.observe(prompt)
        tok = sampler(logits[0, -1])
        emitted = [tok]
        passes = drafted = accepted = draft_steps = 0
        accept_rate = self.prior_accept
        while True:
            stopper.emit(emitted, stream)
            if stopper.done:
                break
            emitted, n, g, accept_rate = self.round(drafter, cache, tok, stopper, accept_rate, gen, sampler)
            draft_steps += g
            passes += 1
            drafted += g
            accepted += n
            tok = emitted[-1]
        ntok = max(len(stopper.tokens), 1)
        n_layers = model.cfg.num_layers
        return stopper.result(
            t0,
            prompt,
            stats={
                "verify_passes": passes,
                "mean_accepted": (accepted + passes) / passes if passes else 0.0,
                "acceptance_rate": accepted / drafted if drafted else 0.0,
                "verify_passes_per_token": passes / ntok,
                "draft_layers_per_token": draft_steps * drafter.layers_per_step / ntok,
                "layers_per_token": (passes * n_layers + draft_steps * drafter.layers_per_step) / ntok,
                **(drafter.stats() if hasattr(drafter, "stats") else {}),  # the drafter's own (exit depths)
                # measured once per strategy, in units of a one-token slow step (what decides drafting)
                **(
                    {
                        "draft_cost": self.costs.draft / self.costs.verify[0],
                        "verify_cost": [v / self.costs.verify[0] for v in self.costs.verify],
                    }
                    if self.costs is not None
                    else {}
                ),
            },
        )

    def round(
        self,
        drafter: Drafter,
        cache: KVCache,
        tok: int,
        stopper: Stopper,
        accept_rate: float,
        gen: GenerationConfig,
        sampler: Sampler,
    ) -> tuple[list[int], int, int, float]:
        """One draft-and-verify round after ``tok`` (the newest token, not yet in ``cache``).

        Returns the emitted tokens (accepted drafts, then the slow model's next token, which is
        again not in the cache), the number of drafts accepted and drafted, and the updated
        running acceptance rate. A round is also the unit the server interleaves with batched steps.
        """
        verified = cache.length
        room = min(stopper.budget - len(stopper.tokens) - 1, cache.max_len - verified - 1)
        cap = min(self.max_draft, room)
        if self.costs is not None:
            cap = self.costs.best_length(accept_rate, cap)
        drafts, qs = self._draft(drafter, tok, verified, cap, gen, sampler)
        # greedy: the pass and each row's argmax in one C++ call where the kernel has it (the same tokens)
        fused = self.model.greedy_pass([tok, *drafts], cache, verified) if gen.greedy else None
        if fused is not None:
            n, nxt = self._accept_greedy(drafts, fused[0])
        else:
            block = torch.tensor([[tok, *drafts]], device=self.model.device)
            verify = self.model(block, cache, verified)[0]  # [g+1, V]
            n, nxt = self._accept(drafts, qs, verify, gen, sampler)
        if drafts:  # running per-draft acceptance, for the next round's draft length
            accept_rate = 0.8 * accept_rate + 0.2 * (n / len(drafts))
        cache.truncate(verified + 1 + n)
        drafter.observe([tok, *drafts[:n]])
        return [*drafts[:n], nxt], n, len(drafts), accept_rate

    def _draft(
        self, drafter: Drafter, tok: int, verified: int, cap: int, gen: GenerationConfig, sampler: Sampler
    ) -> tuple[list[int], list[Tensor]]:
        drafts: list[int] = []
        qs: list[Tensor] = []
        if cap <= 0:
            return drafts, qs
        drafter.start(verified)
        x = tok
        for _ in range(cap):
            logits, p_accept = drafter.step(x)
            if gen.greedy:
                x = int(logits.argmax())
            else:
                q = warp_probs(logits, gen)
                x = int(torch.multinomial(q, 1, generator=sampler.rng))
                qs.append(q)
            drafts.append(x)
            if p_accept is not None and p_accept < self.stop_below:
                break
        return drafts, qs

    @staticmethod
    def _accept_greedy(drafts: list[int], target: list[int]) -> tuple[int, int]:
        """Greedy: the drafts that match the slow model's token at each row (``target``), and its token after them."""
        n = 0
        while n < len(drafts) and drafts[n] == target[n]:
            n += 1
        return n, int(target[n])

    @staticmethod
    def _accept(
        drafts: list[int], qs: list[Tensor], verify: Tensor, gen: GenerationConfig, sampler: Sampler
    ) -> tuple[int, int]:
        """Number of drafts kept and the slow model's next token after them."""
        if gen.greedy:
            return SelfSpeculative._accept_greedy(drafts, argmax_rows(verify).tolist())
        p = warp_probs(verify, gen)
        rng = sampler.rng
        for i, d in enumerate(drafts):
            q = qs[i]
            if float(torch.rand((), generator=rng)) * float(q[d]) < float(p[i, d]):
                continue  # accepted with probability min(1, p/q)
            residual = (p[i] - q).clamp_min(0)
            total = float(residual.sum())
            dist = residual / total if total > 0 else p[i]
            return i, int(torch.multinomial(dist, 1, generator=rng))
        return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=rng))


class FastStreamDrafter:
    """Drafts with the M2R2 fast stream: the path's base layers + adapters over the shared slow cache.

    ``use_arla`` returns ARLA's acceptance estimate so drafting can stop early; without it the
    draft's own top-1 probability serves (CALM-style confidence).
    """

    def __init__(self, fast: FastStream, cache: KVCache, exit: int | None = None, use_arla: bool = True) -> None:
        self.fast, self.cache = fast, cache
        self.exit = exit or fast.cfg.depth
        self.use_arla = use_arla
        self.layers_per_step = fast.cfg.depth
        self.verified = 0
        self.block: DraftBlock | None = None

    def start(self, verified_len: int) -> None:
        self.verified, self.block = verified_len, None

    def observe(self, tokens: list[int]) -> None:
        pass  # the verified context is the slow cache itself

    def step(self, token: int) -> tuple[Tensor, float | None]:
        ids = torch.tensor([[token]], device=self.fast.base.device)
        out = self.fast.draft_step(ids, self.cache, self.verified, self.block, self.exit)
        self.block = out.block
        logits = out.logits[0, -1]
        if self.use_arla:
            return logits, float(self.fast.exit_probability([s[0, -1] for s in out.states], self.exit))
        return logits, float(torch.softmax(logits, -1).max())


def build_self_speculative(
    name: str,
    engine: Loaded,
    fast: FastStream,
    max_draft: int = 8,
    stop_below: float = 0.2,
    use_arla: bool = True,
    adaptive: bool = True,
    cost_cache: bool = True,
) -> SelfSpeculative:
    """A :class:`SelfSpeculative` strategy drafting with ``fast`` on the engine's model.

    ``adaptive`` caps each draft by the measured costs (kept per machine and drafter shape in
    ``$M2R2_CACHE/costs`` for a day when ``cost_cache``; otherwise measured on every build).
    """
    fast.to(engine.model.device).freeze(merge=True)

    def make(cache: object) -> Drafter:
        return FastStreamDrafter(fast, cache, use_arla=use_arla)  # type: ignore[arg-type]

    costs = None
    if adaptive:

        def measure() -> CostModel:
            return measure_costs(engine.model, make, max_draft)

        costs = cached_costs(cost_cache_path(engine, fast, max_draft), measure) if cost_cache else measure()
    return SelfSpeculative(
        name,
        engine.model,
        make,
        engine.tokenizer.eos_ids,
        engine.tokenizer.decode,
        max_draft=max_draft,
        stop_below=stop_below,
        costs=costs,
    )


@register(
    "m2r2",
    "M2R2 self-speculation: the fast stream drafts (token trees when seeded), the slow stream verifies (lossless)",
)
def _m2r2(
    engine: Loaded,
    adapters: str | None = None,
    max_draft: int = 8,
    stop_below: float = 0.2,
    use_arla: bool = True,
    adaptive: bool = True,
    cost_cache: bool = True,
    max_nodes: int = 8,
    max_depth: int = 5,
    width: int = 2,
    branch: int = 2,
    lookup: int = DEFAULT_LOOKUP,
    answers: str | None = None,
    online_costs: bool = True,
    head_bits: int = 4,
    draft: str = "pays",
    copy_price: str = "opinion",
    store_calib: str = "depth",
) -> SelfSpeculative | TreeSpeculative:
    """Seeded adapters (the shipped default where they exist) draft token trees; prefix adapters draft chains.
    ``online_costs``: trees correct the measured verify costs by each answer's own passes
    (:class:`m2r2.decoding.tree.VerifyFit`). ``draft``: when a tree's fast stream drafts: ``pays`` (the default: in
    the kinds of round, with a copied chain proposed or without, where its own accepted tokens have paid for its
    marginal wall clock over every answer so far, :class:`m2r2.decoding.tree.DraftLedger`), ``always`` (every round
    while it gains more than a plain round costs), ``uncopied`` (only where prompt lookup and the answer store
    propose nothing), ``never`` (copies alone: what the stream adds beside them). ``copy_price``: how a tree prices
    prompt lookup's copied nodes: by their match class (a long match, a split n-gram or another) and whether the answer
    store proposes the same first token (``opinion``, the default), by their match class alone (``match``) or by depth
    alone (``depth``, :data:`m2r2.decoding.tree.COPY_PRICES`). ``store_calib``: the answer store's chains calibrated
    per sequence for their first node and their later ones apart (``depth``, the default) or by one factor (``chain``).
    ``head_bits``: a seeded stream's draft head in the C++ kernels'
    4-bit blocks (4, the default) or 8-bit ones (8): half the bytes a draft reads (the start of a drafting round
    0.099 -> 0.078 of a step, a level 0.025 -> 0.022) for 0.012 less agreement at the first draft; drafts only,
    the output is the same (BENCHMARKS.md, "Thirty-third round")."""
    if head_bits not in (4, 8):
        raise ValueError(f"head_bits must be 4 or 8, not {head_bits}")
    from m2r2.multirate.io import bundled_adapters, load_default
    from m2r2.multirate.seeded import SeededFastStream

    path = Path(adapters) if adapters else bundled_adapters(engine.fingerprint, "seeded")
    fast = load_default(engine.model, engine.fingerprint, path)
    if isinstance(fast, SeededFastStream):
        drafter = SeededDrafter(fast.to(engine.model.device).freeze(merge=True, head_bits=head_bits))
        tree = (max_nodes, max_depth, width, branch, lookup)
        extra = {"answers": answers, "online_costs": online_costs, "draft": draft}
        extra |= {"copy_price": copy_price, "store_calib": store_calib}
        return build_tree_speculative("m2r2", engine, drafter, adaptive, cost_cache, *tree, **extra)
    return build_self_speculative("m2r2", engine, fast, max_draft, stop_below, use_arla, adaptive, cost_cache)


@register("early-exit-spec", "ablation: the same self-speculative loop drafting by plain early exit (no adapters)")
def _early_exit_spec(
    engine: Loaded,
    depth: int | None = None,
    max_draft: int = 8,
    stop_below: float = 0.2,
    adaptive: bool = True,
    cost_cache: bool = True,
) -> SelfSpeculative:
    from m2r2.multirate.io import bundled_adapters, read_meta

    if depth is None:  # same draft layers as the shipped adapters, so the ablation isolates them
        shipped = bundled_adapters(engine.fingerprint, "prefix")
        depth = len(read_meta(shipped)["config"]["path"]) if shipped else engine.model.cfg.num_layers // 3
    cfg = FastConfig.build(engine.model.cfg.num_layers, depth=depth, rank=1)
    fast = FastStream(engine.model, cfg)  # zero-initialised B: every adapter delta is exactly zero
    fast.use_adapters = False
    return build_self_speculative("early-exit-spec", engine, fast, max_draft, stop_below, False, adaptive, cost_cache)
