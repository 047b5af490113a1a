"""Lookahead decoding (Fu et al., 2024): Jacobi iteration plus an n-gram pool, training-free.

Each step is one forward pass over three groups of tokens that cannot see each other except
through the verified prefix:

* the current token ``t`` (position L): its logits give the next token for certain;
* a Jacobi window ``g_1..g_W`` (positions L+1..L+W, causal among ``[t, g]``): its argmaxes are the
  next, slightly better guesses of the tokens that follow, and consecutive runs of them become
  n-grams in the pool (keyed by their first token);
* up to ``G`` pooled n-grams that start with ``t`` (positions L+1..L+N-1 each, causal within the
  candidate): their logits verify them.

The longest candidate prefix that matches the model's own argmax chain is accepted; its K/V are
already in the cache and are moved next to the prefix (:meth:`KVCache.keep`), so acceptance costs
no extra pass. Greedy output equals plain greedy decoding; sampling is not supported here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from m2r2.decoding import register
from m2r2.decoding.base import (
    GenerationConfig,
    GenerationResult,
    StreamCallback,
    begin,
)
from m2r2.errors import SettingsError
from m2r2.model import ROW_INVARIANT_MAX_ROWS, Transformer

if TYPE_CHECKING:
    from m2r2.cache import Conversation
    from m2r2.decoding.base import Loaded


class NgramPool:
    """n-grams keyed by first token, most recent first, at most ``per_key`` per key."""

    def __init__(self, n: int, per_key: int) -> None:
        self.size, self.per_key = n, per_key
        self.pool: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add_sequence(self, seq: list[int]) -> None:
        for i in range(len(seq) - self.size + 1):
            gram = tuple(seq[i : i + self.size])
            bucket = self.pool.setdefault(gram[0], OrderedDict())
            bucket.pop(gram[1:], None)
            bucket[gram[1:]] = None
            while len(bucket) > self.per_key:
                bucket.popitem(last=False)

    def candidates(self, first: int, limit: int) -> list[tuple[int, ...]]:
        bucket = self.pool.get(first)
        return list(reversed(bucket))[:limit] if bucket else []


class Lookahead:
    """Greedy lookahead decoding with window ``W``, n-gram size ``N`` and ``G`` candidates per step."""

    name = "lookahead"

    def __init__(
        self,
        model: Transformer,
        eos_ids: list[int],
        decode: Callable[[list[int]], str] | None = None,
        window: int = 5,
        ngram: int = 4,
        candidates: int = 5,
    ) -> None:
        if window < 1 or ngram < 2 or candidates < 1:
            raise SettingsError("lookahead needs window >= 1, ngram >= 2, candidates >= 1")
        rows = 1 + window + candidates * (ngram - 1)
        if rows > ROW_INVARIANT_MAX_ROWS:
            # beyond this, a step's rows no longer get decoding's exact bits: output could drift
            raise SettingsError(
                f"a lookahead step of {rows} tokens (1 + window + candidates x (ngram-1)) exceeds "
                f"{ROW_INVARIANT_MAX_ROWS}, the most that stays bit-identical to plain decoding"
            )
        self.model, self.eos_ids, self.decode = model, eos_ids, decode
        self.window, self.ngram, self.candidates = window, ngram, candidates

    def _layout(self, verified: int, cands: list[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE positions and attention mask of one step's tokens (cache slots follow ``verified``)."""
        w = self.window
        pos = list(range(verified, verified + 1 + w))
        groups = [(0, 1 + w)]  # [t, g_1..g_W] is one causal run
        for c in cands:
            groups.append((len(pos), len(c)))
            pos += range(verified + 1, verified + 1 + len(c))
        t = len(pos)
        mask = torch.zeros(t, verified + t, dtype=torch.bool)
        mask[:, :verified] = True
        mask[:, verified] = True  # everything sees the current token
        for start, length in groups:
            idx = torch.arange(start, start + length)
            mask[idx[:, None], verified + idx[None, :]] = idx[None, :] <= idx[:, None]
        dev = self.model.device
        return torch.tensor(pos, device=dev), mask.to(dev)

    @torch.inference_mode()
    def generate(
        self,
        prompt: list[int],
        gen: GenerationConfig,
        stream: StreamCallback | None = None,
        session: Conversation | None = None,
    ) -> GenerationResult:
        gen.validate()
        if not gen.greedy:
            raise SettingsError("lookahead decoding here is greedy only; use temperature 0 or another method")
        model = self.model
        t0, stopper, cache, logits = begin(model, prompt, gen, self.eos_ids, self.decode, session=session)
        step_tokens = 1 + self.window + self.candidates * (self.ngram - 1)
        ctx = model.cfg.max_position_embeddings
        dev = model.device
        tok = int(logits[0, -1].argmax())
        pool = NgramPool(self.ngram, per_key=self.candidates)
        pool.add_sequence(prompt)
        # Jacobi window initialised from the prompt's tail (any guess works; these are cheap)
        guess = (prompt * (1 + self.window // max(len(prompt), 1)))[-self.window :]
        emitted, passes, accepted = [tok], 0, 0
        while True:
            stopper.emit(emitted, stream)
            if stopper.done:
                break
            verified = cache.length
            if verified + step_tokens > cache.max_len or verified + step_tokens > ctx:
                # too close to the end for a full step: plain decoding for the rest
                fused = model.greedy_pass([tok], cache, verified)
                if fused is not None:  # the step and its argmax in one C++ call where the kernel has it
                    emitted = fused[0]
                else:
                    emitted = [int(model(torch.tensor([[tok]], device=dev), cache, verified)[0, -1].argmax())]
                tok = emitted[0]
                passes += 1
                continue
            cands = pool.candidates(tok, self.candidates)
            positions, mask = self._layout(verified, cands)
            ids = [tok, *guess, *(x for c in cands for x in c)]
            fused = model.greedy_pass(ids, cache, verified, positions, mask)
            if fused is not None:  # the pass and each row's argmax in one C++ call (the same tokens)
                top = fused[0]
            else:
                out = model(torch.tensor([ids], device=dev), cache, verified, positions=positions, mask=mask)[0]
                top = out.argmax(-1).tolist()
            passes += 1
            nxt = top[0]
            # verify candidates: c[0] must be the true next token, c[i] the argmax after c[i-1]
            best_len, best_slots, best_follow, base = 0, [], nxt, 1 + self.window
            for c in cands:
                m = 0
                expect = nxt
                while m < len(c) and c[m] == expect:
                    expect = top[base + m]
                    m += 1
                if m > best_len:
                    best_len, best_slots = m, list(range(base, base + m))
                    best_follow = expect
                base += len(c)
            # Jacobi update: the window's argmaxes are the next guesses; harvest n-grams from them
            jacobi = [nxt, *top[1 : 1 + self.window]]
            pool.add_sequence([tok, *jacobi])
            if best_len:
                emitted = [nxt, *[ids[s] for s in best_slots[1:]], best_follow]
                slots = [verified, *(verified + s for s in best_slots)]
                cache.keep(slots, verified)
                accepted += best_len - 1
                tok = emitted[-1]
                guess = jacobi[best_len + 1 :]
            else:
                emitted = [nxt]
                cache.truncate(verified + 1)
                tok = nxt
                guess = jacobi[1:]
            guess = (guess + [tok] * self.window)[: self.window]
        ntok = max(len(stopper.tokens), 1)
        return stopper.result(
            t0,
            prompt,
            stats={
                "verify_passes": passes,
                "mean_accepted": ntok / passes if passes else 0.0,
                "verify_passes_per_token": passes / ntok,
                "layers_per_token": passes * model.cfg.num_layers / ntok,
            },
        )


@register("lookahead", "Lookahead Decoding: Jacobi iteration + n-gram pool, training-free, greedy lossless")
def _lookahead(engine: Loaded, window: int = 5, ngram: int = 4, candidates: int = 5) -> Lookahead:
    return Lookahead(engine.model, engine.tokenizer.eos_ids, engine.tokenizer.decode, window, ngram, candidates)
