"""Is the seeded stream held back by what it can fit, or by what it has seen? Its first-draft agreement with the
full model's own token, binned by how sure the full model is there, on the sequences of a small store of own answers
it is then trained on for many epochs, and on held-out sequences of the same store, before and after that training.

Why: on MT-Bench the shipped stream's first draft gets only 0.56 of the positions whose token the model gives >= 0.9
(`agreement_by_confidence.out.txt`). If many epochs on a few hundred answers lift the *trained* sequences' sure
positions near 1 while the held-out ones stay, the stream can represent what it misses and is short of data (GPU-scale
training); if the trained ones stay low too, its shape or its training signal is what holds it back.

    python experiments/stream_fit.py STORE [--holdout N] [--steps N] [--lr LR] [--threads N] [--out DIR]

STORE: `m2r2 store --kv-layers 1` over `distill-data` answers (see the `.out.txt` for the commands).
"""

import argparse
import itertools
from pathlib import Path

import torch
import torch.nn.functional as F

from m2r2.engine import Engine
from m2r2.multirate.io import bundled_adapters, load_adapters, read_draft_vocab
from m2r2.training import seeded_train as st
from m2r2.training.store import TrainStore

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("store")
parser.add_argument("--holdout", type=int, default=64, help="the store's first sequences, kept out of training")
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--out", default="runs/stream-fit")
args = parser.parse_args()

engine = Engine(dtype="fp32", threads=args.threads, quiet=True)
base, fp = engine.model, engine.fingerprint
shipped = bundled_adapters(fp, "seeded")
assert shipped is not None
store = TrainStore(Path(args.store), fp)
seqs = [q for i in range(len(store.shards)) for q in store.sequences(store.load_shard(i))]
held, trained = seqs[: args.holdout], seqs[args.holdout :]
EDGES = (0.0, 0.5, 0.9, 1.01)


@torch.no_grad()
def binned(adapters: Path, sequences: list[dict]) -> list[tuple[int, int, int]]:
    """Per sureness bin: positions, first drafts equal to the model's own token, that token in the draft vocabulary."""
    stream = load_adapters(adapters, base, fp)
    stream.eval()
    vocab = stream.draft_vocab
    bins = [[0, 0, 0] for _ in EDGES[:-1]]
    for i in range(0, len(sequences), 16):
        batch = st.pad_batch(sequences[i : i + 16], len(stream.cfg.layers))
        hidden, valid = batch["hidden"], batch["valid"].clone()
        valid[:, 0] = False  # position 0 has no seed
        full = F.linear(base.norm(hidden), stream.head_weight(full=True).float()).softmax(-1).max(-1)
        f = stream.forward_chain(batch["tokens"], hidden, batch["k"], batch["v"], 1)[0][-1]
        picks = vocab[F.linear(base.norm(f), stream.head_weight().float()).argmax(-1)]
        inside = torch.isin(full.indices, vocab)
        for b, (lo, hi) in enumerate(itertools.pairwise(EDGES)):
            m = valid & (full.values >= lo) & (full.values < hi)
            bins[b][0] += int(m.sum())
            bins[b][1] += int((picks == full.indices)[m].sum())
            bins[b][2] += int(inside[m].sum())
    return [tuple(b) for b in bins]


def report(name: str, adapters: Path) -> None:
    for part, sequences in (("trained on", trained), ("held out", held)):
        bins = binned(adapters, sequences)
        n = sum(b[0] for b in bins)
        cells = " | ".join(f"{r / max(c, 1):.3f} ({c / n:.2f}; in vocab {v / max(c, 1):.2f})" for c, r, v in bins)
        print(f"| {name} | {part} | {sum(b[1] for b in bins) / n:.3f} | {cells} |", flush=True)


tokens = sum(len(q["tokens"]) for q in trained)
print(f"store {args.store}: {len(trained)} sequences ({tokens} tokens) to train on, {len(held)} held out")
print("| stream | sequences | first draft right | p < 0.5 (share) | 0.5-0.9 | >= 0.9 |")
print("|---|---|--:|--:|--:|--:|")
report("shipped", shipped)
settings = st.SeededTrainSettings(
    store=Path(args.store),
    out=Path(args.out),
    steps=args.steps,
    minutes=0,
    batch=16,
    lr=args.lr,
    holdout=args.holdout,
    seed=0,
    resume=False,
    warmup=10,
    init=str(shipped),
    bf16=True,
    depth=1,
    rank=128,
    chain=3,
    oov="flat",
)
st.train_seeded(base, fp, settings, read_draft_vocab(shipped, base.cfg.vocab_size))
epochs = args.steps * 16 / len(trained)
report(f"+{args.steps} steps ({epochs:.0f} epochs)", Path(args.out) / "adapters.safetensors")
