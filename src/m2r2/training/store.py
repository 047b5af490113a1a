"""A sharded, resumable on-disk store of what fast-stream training needs from the frozen base model.

Why: a training step that re-runs the 30-layer base model spends ~90% of its time on a pass whose
result never changes (the base is frozen). One batched no-grad pass writes, per token, the final
slow residual ``h_N`` (the seeded fast stream's input and alignment target; the target distribution
is ``W . Norm(h_N)``) and the slow K/V of the last ``kv_layers`` base layers (what a deep fast layer
attends to over verified positions). Training then runs only the fast stream.

Layout: ``DIR/manifest.json`` (base fingerprint, data file and its hash, settings, shard list) and
``DIR/shard-NNNNN.safetensors``, each holding ``tokens [n]``, ``offsets [S+1]`` (ragged sequences),
``hidden [n, d]``, ``k``/``v`` ``[L, n, kv_heads, head_dim]`` (and, with ``taps``, ``taps [n, len, d]``)
in bf16, plus the SHA-256 of each
shard in the manifest. Shards and the manifest are written atomically (temporary file + rename) and
the manifest is rewritten after each shard, so a killed build resumes at the next unwritten
conversation without duplicating or losing one. A store built for another base model, a shard whose
checksum does not match, or a missing shard is refused with a one-line error.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from m2r2 import amx
from m2r2.errors import InputError, SettingsError, WeightsError
from m2r2.loading import file_hash
from m2r2.machine import cpu_has
from m2r2.model import Transformer

FORMAT = "m2r2-train-store"
VERSION = 1

#: Sampling weights per source of ``conversations.jsonl``: FLAN chain-of-thought (39% of the file),
#: tool-use and P3 templates are short, formulaic answers unlike chat, so they are capped; chat-like
#: and instruction sources share the rest. Unknown sources get 0.1. Any prefix of the interleaved
#: order has this mix (stride scheduling), so a store stopped at any point is balanced.
CONVERSATION_WEIGHTS: dict[str, float] = {
    "alpaca_5000": 0.16,
    "alpaca_cleaned_1000": 0.04,
    "alpaca_en_demo": 0.04,
    "lima": 0.06,
    "oasst_tree": 0.01,
    "oasst_deepseek_v3": 0.01,
    "dpo_en_demo": 0.01,
    "self_instruct_seed": 0.01,
    "gpteacher_roleplay": 0.06,
    "gpteacher_codegen": 0.09,
    "code_alpaca": 0.04,
    "gsm8k": 0.10,
    "flan_cot": 0.16,
    "p3_t0": 0.08,
    "gpteacher_toolformer": 0.04,
}


@dataclass
class StoreSettings:
    data: str
    max_len: int = 256
    batch: int = 8
    shard_sequences: int = 128
    kv_layers: int = 4  # K/V of the last this-many base layers are stored
    weights: str = "conversations"
    #: of the base pass: bf16 (oneDNN kernels) is several times faster than fp32 on CPUs with AMX, and
    #: the store keeps bf16 states either way (measured for Qwen2.5-Coder-1.5B in docs/TRAINING.md)
    precision: str = "fp32"
    #: base layers (0-based) whose output residual is stored too: the features a *tapped* seeded stream
    #: fuses into its seed (:class:`m2r2.multirate.seeded.SeededConfig`)
    taps: list[int] = field(default_factory=list)
    #: the base pass's linear-layer kernel ("" = oneDNN for bf16, torch for fp32). A decoding kernel
    #: (``q4-avx2``...) stores the very states and next tokens the stream is seeded with and verified
    #: against at inference, which differ from oneDNN's on a few percent of tokens
    kernel: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key, default in (("precision", "fp32"), ("taps", []), ("kernel", "")):
            if d[key] == default:
                del d[key]  # so stores built before the option existed still resume
        return d


def store_precision(out: Path) -> str:
    """The base pass precision a store build uses unless told: a resumed store's own (a build must not
    mix them), else bf16 where the CPU multiplies bf16 natively (AVX512-BF16 or AMX: 653 vs 197 tokens/s
    for fp32 on one Zen 5 core, docs/TRAINING.md) or on a GPU, else fp32."""
    man = Path(out) / "manifest.json"
    if man.is_file():
        try:
            return str(json.loads(man.read_text()).get("settings", {}).get("precision", "fp32"))
        except (OSError, json.JSONDecodeError):
            pass  # build_store reports the damaged manifest
    if torch.cuda.is_available() or cpu_has("avx512_bf16") or cpu_has("amx_bf16"):
        return "bf16"
    return "fp32"


def _atomic(path: Path, write: Callable[[Path], object]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_conversations(path: Path) -> list[dict[str, Any]]:
    """Conversation records (``messages``) or the base model's own answers from ``m2r2 distill-data``
    (``prompt_ids`` + ``answer_ids``: already tokens, stored as they are)."""
    from m2r2.training.distill import refuse_eval

    refuse_eval(path)
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise InputError(f"cannot read conversations {path}: {e}") from e
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            tokens = isinstance(rec.get("prompt_ids"), list) and isinstance(rec.get("answer_ids"), list)
            if not tokens and (not isinstance(rec.get("messages"), list) or not rec["messages"]):
                raise ValueError("neither messages nor prompt_ids/answer_ids")
        except (json.JSONDecodeError, ValueError, AttributeError) as e:
            raise InputError(f"{path}:{i + 1}: not a conversation record ({e})") from None
        out.append(rec)
    if not out:
        raise InputError(f"{path} holds no conversations")
    return out


def assistant_turns(path: Path) -> list[str]:
    """The assistant turns of a conversations file: the text an answer store may also count (REST's kind of
    datastore, ``m2r2 answer-store --corpus``)."""
    texts = [
        m["content"]
        for rec in read_conversations(path)
        for m in rec.get("messages") or []
        if isinstance(m, dict) and m.get("role") == "assistant" and str(m.get("content", "")).strip()
    ]
    if not texts:
        raise InputError(f"no assistant turns in {path}")
    return texts


def conversation_order(path: Path) -> list[dict[str, Any]]:
    """Records of ``path`` interleaved by source weight; deterministic, so a resumed build sees the same order."""
    from m2r2.training.distill import rebalance

    return rebalance(read_conversations(path), CONVERSATION_WEIGHTS)


class TrainStore:
    """Read access to a built store: the manifest, shard checks and sequence batches."""

    def __init__(self, root: Path, fingerprint: str | None = None) -> None:
        self.root = Path(root)
        man = self.root / "manifest.json"
        try:
            self.manifest = json.loads(man.read_text())
        except FileNotFoundError:
            raise InputError(
                f"{self.root} is not a training store (no manifest.json); build one with `m2r2 store`"
            ) from None
        except (OSError, json.JSONDecodeError) as e:
            raise WeightsError(f"training store manifest {man} is unreadable or corrupt: {e}") from e
        if self.manifest.get("format") != FORMAT:
            raise WeightsError(f"{man} is not an m2r2 training store manifest")
        if fingerprint is not None and self.manifest.get("base_fingerprint") != fingerprint:
            raise WeightsError(
                f"training store {self.root} was built for another base model "
                f"({self.manifest.get('base_fingerprint')}, this one is {fingerprint}); build a store for it"
            )
        self.shards: list[dict[str, Any]] = self.manifest["shards"]
        if not self.shards:
            raise InputError(f"training store {self.root} has no shards yet")

    @property
    def tokens(self) -> int:
        return sum(int(s["tokens"]) for s in self.shards)

    @property
    def kv_layers(self) -> list[int]:
        return [int(i) for i in self.manifest["kv_layer_ids"]]

    @property
    def taps(self) -> list[int]:
        """Base layers whose output residual each token carries (``taps [n, len, d]``)."""
        return [int(i) for i in self.manifest.get("settings", {}).get("taps", [])]

    def load_shard(self, i: int, verify: bool = True, kv: bool = True) -> dict[str, Tensor]:
        """Shard ``i``'s tensors; without ``kv`` its K/V are not read (most of a shard's bytes: a drafter
        that reads only ``h_N``, Medusa heads, fits a ~4x larger store in memory)."""
        meta = self.shards[i]
        path = self.root / meta["file"]
        if not path.is_file():
            raise WeightsError(f"training store shard {path} is missing")
        if verify and file_hash(path) != meta["sha256"]:
            raise WeightsError(f"training store shard {path} is corrupt (checksum mismatch); delete it and rebuild")
        try:
            with safe_open(str(path), framework="pt") as fh:
                return {k: fh.get_tensor(k) for k in fh.keys() if kv or k not in ("k", "v")}  # noqa: SIM118
        except (SafetensorError, OSError, RuntimeError) as e:
            raise WeightsError(f"training store shard {path} is corrupt: {e}") from e

    def sequences(self, shard: dict[str, Tensor]) -> Iterator[dict[str, Tensor]]:
        off = shard["offsets"].tolist()
        for a, b in itertools.pairwise(off):
            seq = {"tokens": shard["tokens"][a:b].long(), "hidden": shard["hidden"][a:b]}
            if "taps" in shard:
                seq["taps"] = shard["taps"][a:b]
            yield seq | {kv: shard[kv][:, a:b] for kv in ("k", "v") if kv in shard}


def _empty_manifest(fingerprint: str, s: StoreSettings, data_hash: str, model: Transformer) -> dict[str, Any]:
    n = model.cfg.num_layers
    return {
        "format": FORMAT,
        "version": VERSION,
        "base_fingerprint": fingerprint,
        "data_sha256": data_hash,
        "settings": s.to_dict(),
        "kv_layer_ids": list(range(n - s.kv_layers, n)),
        "hidden_size": model.cfg.hidden_size,
        "conversations_done": 0,
        "shards": [],
    }


@torch.inference_mode()
def slow_pass(
    model: Transformer, seqs: list[list[int]], kv_ids: list[int], taps: list[int] | None = None
) -> list[dict[str, Tensor]]:
    """One batched no-grad base pass over right-padded ``seqs``: per sequence its ``h_N``, K/V and the
    output residuals of the ``taps`` layers (``[n, len(taps), d]``).

    Right padding never changes a real token's result under a causal mask, so each sequence gets
    what a pass over it alone would give (up to the kernel's batch-size rounding).
    """
    b, t = len(seqs), max(len(s) for s in seqs)
    ids = torch.zeros(b, t, dtype=torch.long, device=model.device)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    cache = model.new_cache(t, batch=b)
    layers: list[Tensor] = []
    with amx.decoding_bits():  # the states decoding gives, not a prefill's (stored sequences are prompt-length passes)
        h = model.run_layers(model.embed_tokens(ids), cache, 0, layers if taps else None)
    out = []
    for i, s in enumerate(seqs):
        n = len(s)
        row = {
            "tokens": torch.tensor(s, dtype=torch.int32),
            "hidden": h[i, :n].to(torch.bfloat16).cpu(),
            "k": cache.k[kv_ids, i, :, :n].transpose(1, 2).to(torch.bfloat16).cpu(),  # [L, n, kvh, D]
            "v": cache.v[kv_ids, i, :, :n].transpose(1, 2).to(torch.bfloat16).cpu(),
        }
        if taps:
            row["taps"] = torch.stack([layers[j][i, :n] for j in taps], dim=1).to(torch.bfloat16).cpu()
        out.append(row)
    return out


def build_store(
    model: Transformer,
    fingerprint: str,
    encode: Callable[[list[dict[str, str]]], list[int]],
    out: Path,
    s: StoreSettings,
    limit: int = 0,
    minutes: float = 0.0,
    progress: Callable[[int, int, float], None] | None = None,
) -> dict[str, Any]:
    """Append shards to the store at ``out`` until ``limit`` conversations (0 = all) or ``minutes`` pass.

    Resumes an existing store after checking it was built for this model, data and settings.
    """
    if s.max_len < 8 or s.batch < 1 or s.shard_sequences < 1 or not 1 <= s.kv_layers <= model.cfg.num_layers:
        raise SettingsError("store: max_len >= 8, batch >= 1, shard_sequences >= 1, kv_layers in 1..num_layers")
    if not all(0 <= i < model.cfg.num_layers for i in s.taps):
        raise SettingsError(f"store: taps must be base layers 0..{model.cfg.num_layers - 1}, got {s.taps}")
    data = Path(s.data)
    data_hash = file_hash(data) if data.is_file() else ""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    man_path = out / "manifest.json"
    if man_path.exists():
        try:
            man = json.loads(man_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise WeightsError(f"training store manifest {man_path} is corrupt: {e}") from e
        if man.get("format") != FORMAT or man.get("base_fingerprint") != fingerprint:
            raise WeightsError(f"training store {out} was built for another base model; use another --out")
        if man.get("data_sha256") != data_hash or man.get("settings") != s.to_dict():
            raise SettingsError(f"training store {out} was built from other data or settings; use another --out")
    else:
        man = _empty_manifest(fingerprint, s, data_hash, model)
    order = conversation_order(data)
    end = min(len(order), limit) if limit else len(order)
    done = int(man["conversations_done"])
    kv_ids = man["kv_layer_ids"]
    # the 4-bit decoding kernels run a padded batch on another path than decoding's, while one sequence's
    # pass gives every position the bits of its one-token step: the states inference will seed from
    batch = 1 if s.kernel.startswith("q4") else s.batch
    t0 = time.perf_counter()
    while done < end and not (minutes and time.perf_counter() - t0 > minutes * 60):
        chunk = order[done : min(end, done + s.shard_sequences)]
        seqs = [
            (encode(r["messages"]) if "messages" in r else r["prompt_ids"] + r["answer_ids"])[: s.max_len]
            for r in chunk
        ]
        idx = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))  # less padding per batch
        rows: dict[int, dict[str, Tensor]] = {}
        for j in range(0, len(idx), batch):
            part = idx[j : j + batch]
            for i, r in zip(part, slow_pass(model, [seqs[i] for i in part], kv_ids, s.taps), strict=True):
                rows[i] = r
        kept = [rows[i] for i in range(len(seqs)) if len(seqs[i]) >= 2]
        lengths = [len(r["tokens"]) for r in kept]
        shard = {
            "tokens": torch.cat([r["tokens"] for r in kept]),
            "offsets": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64),
            "hidden": torch.cat([r["hidden"] for r in kept]),
            "k": torch.cat([r["k"] for r in kept], dim=1).contiguous(),
            "v": torch.cat([r["v"] for r in kept], dim=1).contiguous(),
        }
        if s.taps:
            shard["taps"] = torch.cat([r["taps"] for r in kept])
        name = f"shard-{len(man['shards']):05d}.safetensors"
        _atomic(out / name, lambda p, sh=shard: save_file(sh, str(p), metadata={"format": FORMAT}))
        done += len(chunk)
        man["shards"].append(
            {"file": name, "sha256": file_hash(out / name), "sequences": len(kept), "tokens": sum(lengths)}
        )
        man["conversations_done"] = done
        _atomic(man_path, lambda p: p.write_text(json.dumps(man, indent=1) + "\n"))
        if progress is not None:
            progress(done, end, time.perf_counter() - t0)
    return man


def store_digest(root: Path) -> str:
    """A short hash naming a store's contents (for checkpoints trained on it)."""
    man = json.loads((Path(root) / "manifest.json").read_text())
    return hashlib.sha256(json.dumps([s["sha256"] for s in man["shards"]]).encode()).hexdigest()[:16]
