"""Quality of MoEfied SmolLM2 settings against the dense model (numbers in MOEFY_NOTES.md).

For each (method, E) one MoE is built from the same collected activations; each top-k is then
evaluated by setting the routers' k. On the first turns of ``--prompts`` MT-Bench prompts:

- ROUGE-L F (rouge_score, stemming) of the MoE's greedy answer against the dense greedy answer
  (both up to ``--tokens`` new tokens, stopping at EOS);
- NLL: mean negative log-likelihood per token of the *dense* greedy answer under the model
  (teacher-forced on prompt + dense answer); the dense model's own NLL of it is the floor;
- top-1 agreement with the dense model on those teacher-forced answer positions.

Usage: OMP_NUM_THREADS=1 .venv/bin/python experiments/moefy_eval.py --settings coact:16:4,8 weights:16:4,8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from m2r2.bench.datasets import load_dataset
from m2r2.decoding.autoregressive import Autoregressive
from m2r2.decoding.base import GenerationConfig
from m2r2.loading import load_model, resolve_model
from m2r2.model import MoE, Transformer
from m2r2.moe.moefy import DEFAULT_DATA, MoefySettings, collect_activations, moefy, read_sequences
from m2r2.tokenizer import ChatTokenizer


@torch.inference_mode()
def answer_nll(model: Transformer, prompt: list[int], answer: list[int]) -> tuple[float, list[int]]:
    ids = torch.tensor([prompt + answer])
    logp = model(ids, model.new_cache(ids.shape[1]), 0)[0, len(prompt) - 1 : -1].log_softmax(-1)
    tgt = torch.tensor(answer)
    return float(-logp.gather(-1, tgt[:, None]).mean()), logp.argmax(-1).tolist()


def evaluate(model: Transformer, tok: ChatTokenizer, prompts: list[list[int]], ref: list[list[int]], n: int):
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    gen = GenerationConfig(max_new_tokens=n)
    rouge, nll, agree, t0 = [], [], [], time.perf_counter()
    for p, r in zip(prompts, ref, strict=True):
        out = Autoregressive(model, tok.eos_ids).generate(p, gen).tokens
        rouge.append(scorer.score(tok.decode(r), tok.decode(out))["rougeL"].fmeasure)
        loss, top = answer_nll(model, p, r)
        nll.append(loss)
        agree.append(sum(a == b for a, b in zip(top, r, strict=True)) / len(r))
    k = len(prompts)
    return {
        "rougeL_f": sum(rouge) / k,
        "nll": sum(nll) / k,
        "top1_agree": sum(agree) / k,
        "seconds": time.perf_counter() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--settings", nargs="+", default=["coact:16:4,8", "weights:16:4,8", "coact:8:4"])
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out-root", default="/tmp/moefy_eval")
    ap.add_argument("--json", default="experiments/moefy_eval.json")
    ap.add_argument("--sequences", type=int, default=MoefySettings.sequences, help="training sequences")
    ap.add_argument("--rows", type=int, default=MoefySettings.tokens_per_layer, help="activation rows per layer")
    ap.add_argument("--acts", default=None, help="file to cache collected activations in (torch.save)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    src = resolve_model(None)
    dense = load_model(src, torch.float32, kernel="plain").model
    tok = ChatTokenizer(src)
    prompts = [tok.encode_chat([{"role": "user", "content": p.turns[0]}]) for p in load_dataset("mt_bench").prompts]
    prompts = prompts[: args.prompts]
    gen = GenerationConfig(max_new_tokens=args.tokens)
    ref = [Autoregressive(dense, tok.eos_ids).generate(p, gen).tokens for p in prompts]
    results: dict[str, dict] = {"dense": evaluate(dense, tok, prompts, ref, args.tokens)}
    print("dense", results["dense"], flush=True)
    base = MoefySettings(sequences=args.sequences, tokens_per_layer=args.rows)
    t0 = time.perf_counter()
    seqs = read_sequences(DEFAULT_DATA, base.sequences, base.max_len)
    if args.acts and Path(args.acts).is_file():
        acts = torch.load(args.acts)
    else:
        acts = collect_activations(dense, seqs, base.tokens_per_layer, base.seed)
        if args.acts:
            torch.save(acts, args.acts)
    print(f"activations of {len(seqs)} sequences in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    for spec in args.settings:
        method, e, ks, *rest = spec.split(":")
        shared = int(rest[0]) if rest else 0
        ks_list = [int(k) for k in ks.split(",")]
        s = MoefySettings(
            experts=int(e),
            top_k=ks_list[0],
            method=method,
            shared=shared,
            sequences=args.sequences,
            tokens_per_layer=args.rows,
        )
        out = Path(args.out_root) / f"{method}-e{e}-s{shared}"
        t0 = time.perf_counter()
        stats = moefy(src, out, seqs, s, acts=acts)
        fit_s = time.perf_counter() - t0
        model = load_model(out, torch.float32, kernel="plain").model
        for k in ks_list:
            for b in model.layers:
                if isinstance(b.mlp, MoE):
                    b.mlp.top_k = k
            name = f"{method} E={e} k={k} shared={shared}"
            results[name] = {**evaluate(model, tok, prompts, ref, args.tokens), "fit_seconds": fit_s}
            if k == ks_list[0]:
                results[name].update(oracle_err=stats["oracle_err"], router_err=stats["router_err"])
            print(name, results[name], flush=True)
            Path(args.json).write_text(json.dumps(results, indent=2))  # after each setting: runs are long


if __name__ == "__main__":
    main()
