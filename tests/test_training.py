"""Training on tiny random models: learning happens, resume is exact, bad inputs are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from m2r2.config import ModelConfig
from m2r2.errors import SettingsError, WeightsError
from m2r2.model import Transformer
from m2r2.multirate.fast import FastConfig
from m2r2.multirate.io import load_adapters, tensor_fingerprint
from m2r2.training.distill import DistillSettings, distill, generate_batch, rebalance, refuse_eval
from m2r2.training.loop import DistillLoss, TrainSettings, collate, train

CFG = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_layers": 6, "num_heads": 4, "head_dim": 8}


def tiny(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    m = Transformer(ModelConfig(**CFG)).eval().requires_grad_(False)
    with torch.no_grad():  # larger weights than PyTorch's default init: a peaked, non-trivial teacher
        for blk in m.layers:
            blk.mlp.w2.weight.mul_(4)
            blk.attn.wo.weight.mul_(4)
    return m


def records(n: int = 24, seed: int = 0) -> list[dict]:
    """Random prompts and answers: on random text the early layers disagree with the full model."""
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "id": str(i),
            "source": "x",
            "prompt_ids": torch.randint(1, 64, (4,), generator=g).tolist(),
            "answer_ids": torch.randint(1, 64, (24,), generator=g).tolist(),
        }
        for i in range(n)
    ]


def settings(tmp: Path, **kw) -> TrainSettings:
    d = {
        "out": tmp,
        "steps": 30,
        "batch": 4,
        "max_len": 32,
        "lr": 2e-2,
        "warmup": 1,
        "gamma_max": 3,
        "ckpt_minutes": 1e9,
    }
    d.update(kw)
    return TrainSettings(**d)


def evaluate(model: Transformer, stream, recs: list[dict]) -> tuple[float, float]:
    from m2r2.training.loop import make_sequences

    tokens, mask = collate(make_sequences(recs, 32))
    mod = DistillLoss(stream, settings(Path(".")))
    with torch.no_grad():
        loss, met = mod(tokens, mask, torch.arange(tokens.shape[1]), torch.Generator().manual_seed(0))
    return loss.item(), next(iter(met["agree"].values()))


def test_loss_decreases_and_agreement_rises(tmp_path):
    torch.set_num_threads(1)
    model = tiny()
    recs = records()
    cfg = FastConfig.build(6, rate=3, rank=8)
    from m2r2.multirate.fast import FastStream

    torch.manual_seed(0)
    loss0, agree0 = evaluate(model, FastStream(model, cfg), recs)
    out = train(model, cfg, recs, settings(tmp_path, steps=45), tensor_fingerprint(model))
    loss1, agree1 = evaluate(model, out["stream"], recs)
    assert loss1 < 0.7 * loss0, (loss0, loss1)
    assert agree1 > agree0 + 0.2, (agree0, agree1)
    # the written adapters load back and reproduce the trained stream (bf16 file)
    loaded = load_adapters(tmp_path / "adapters.safetensors", model, tensor_fingerprint(model))
    meta = json.loads((tmp_path / "adapters.json").read_text())
    assert meta["steps"] == 45 and meta["config"]["path"] == [0, 1]
    assert evaluate(model, loaded, recs)[1] == pytest.approx(agree1, abs=0.1)


def test_resume_is_bit_for_bit(tmp_path):
    torch.set_num_threads(1)
    model = tiny(1)
    recs = records(12, seed=1)
    cfg = FastConfig.build(6, rate=2, depth=2, rank=4, exits=[1, 2])
    fp = tensor_fingerprint(model)
    full = train(model, cfg, recs, settings(tmp_path / "a", steps=6), fp)["stream"].state_dict()
    train(model, cfg, recs, settings(tmp_path / "b", steps=3), fp)
    resumed = train(model, cfg, recs, settings(tmp_path / "b", steps=6, resume=True), fp)
    assert resumed["steps_this_run"] == 3
    for k, v in full.items():
        assert torch.equal(resumed["stream"].state_dict()[k], v), k


def test_checkpoint_refusals(tmp_path):
    model = tiny(2)
    recs = records(8, seed=2)
    cfg = FastConfig.build(6, rate=3, rank=4)
    fp = tensor_fingerprint(model)
    train(model, cfg, recs, settings(tmp_path, steps=2), fp)
    with pytest.raises(SettingsError, match="another base model"):
        train(model, cfg, recs, settings(tmp_path, steps=3, resume=True), "0" * 32)
    with pytest.raises(SettingsError, match="fast-stream config"):
        train(model, FastConfig.build(6, rate=3, rank=8), recs, settings(tmp_path, steps=3, resume=True), fp)
    with pytest.raises(SettingsError, match="different settings"):
        train(model, cfg, recs, settings(tmp_path, steps=3, resume=True, lr=0.5), fp)
    with pytest.raises(SettingsError, match="other data"):
        train(model, cfg, records(9, seed=3), settings(tmp_path, steps=3, resume=True), fp)
    ck = tmp_path / "checkpoint.pt"
    ck.write_bytes(ck.read_bytes()[:200])
    with pytest.raises(WeightsError, match="truncated or corrupt"):
        train(model, cfg, recs, settings(tmp_path, steps=3, resume=True), fp)
    with pytest.raises(SettingsError, match="no checkpoint"):
        train(model, cfg, recs, settings(tmp_path / "none", steps=3, resume=True), fp)


def test_distill_rebalances_resumes_and_refuses_eval(tmp_path):
    items = [{"id": f"m{i}", "source": "gsm8k", "turns": ["q"]} for i in range(50)]
    items += [{"id": f"c{i}", "source": "lima", "turns": ["q"]} for i in range(50)]
    head = rebalance(items, {"gsm8k": 1.0, "lima": 3.0})[:20]
    assert sum(it["source"] == "gsm8k" for it in head) == 5
    with pytest.raises(SettingsError):
        refuse_eval(Path("/work/shared/data/eval/mt_bench.jsonl"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "source": "s", "turns": [f"t{i}"]}) + "\n" for i in range(7)))
    model = tiny(3)

    def encode(msgs):
        return [1 + int(msgs[0]["content"][1:]), 5, 6]

    out = tmp_path / "d.jsonl"
    s = DistillSettings(prompts=prompts, out=out, limit=5, max_new_tokens=4, batch=2)
    assert distill(model, encode, [], s) == 5
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:3]) + "\n" + lines[3][:10])  # killed mid-write
    assert distill(model, encode, [], s) == 2
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["id"] for r in recs) == ["0", "1", "2", "3", "4"]
    # a time budget stops after the first answer written past it; a rerun goes on where it stopped
    budget = DistillSettings(
        prompts=prompts, out=tmp_path / "b.jsonl", limit=5, max_new_tokens=4, batch=2, minutes=1e-9
    )
    assert distill(model, encode, [], budget) == 1
    assert distill(model, encode, [], budget) == 1
    budget.minutes = 0.0
    assert distill(model, encode, [], budget) == 3
    assert sorted(json.loads(x)["id"] for x in budget.out.read_text().splitlines()) == ["0", "1", "2", "3", "4"]
    with pytest.raises(SettingsError, match="minutes"):
        distill(model, encode, [], DistillSettings(prompts=prompts, out=out, minutes=-1))
    # batched answers equal one-by-one greedy answers
    solo = {r["id"]: generate_batch(model, [r["prompt_ids"]], 4, [])[0] for r in recs}
    assert all(r["answer_ids"] == solo[r["id"]] for r in recs)


def save_hf(model: Transformer, d: Path) -> None:
    """Write a tiny model as an HF Llama directory (config.json + model.safetensors)."""
    c = model.cfg
    d.mkdir(parents=True)
    q, kv, m = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    sd = {"model.embed_tokens.weight": model.embed.weight, "model.norm.weight": model.norm.weight}
    for i, b in enumerate(model.layers):
        p = f"model.layers.{i}."
        w = b.attn.wqkv.weight
        sd |= {
            p + "self_attn.q_proj.weight": w[:q],
            p + "self_attn.k_proj.weight": w[q : q + kv],
            p + "self_attn.v_proj.weight": w[q + kv :],
            p + "self_attn.o_proj.weight": b.attn.wo.weight,
            p + "mlp.gate_proj.weight": b.mlp.w13.weight[:m],
            p + "mlp.up_proj.weight": b.mlp.w13.weight[m:],
            p + "mlp.down_proj.weight": b.mlp.w2.weight,
            p + "input_layernorm.weight": b.attn_norm.weight,
            p + "post_attention_layernorm.weight": b.mlp_norm.weight,
        }
    save_file({k: v.contiguous() for k, v in sd.items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": c.vocab_size,
                "hidden_size": c.hidden_size,
                "intermediate_size": m,
                "num_hidden_layers": c.num_layers,
                "num_attention_heads": c.num_heads,
                "num_key_value_heads": c.num_kv_heads,
                "head_dim": c.head_dim,
                "rms_norm_eps": c.rms_norm_eps,
                "tie_word_embeddings": True,
                "max_position_embeddings": 256,
            }
        )
    )


def test_two_process_gloo_training_matches_one_process(tmp_path):
    model = tiny(4)
    save_hf(model, tmp_path / "m")
    data = tmp_path / "d.jsonl"
    recs = records(8, seed=4)
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    args = [
        "train",
        "--model",
        str(tmp_path / "m"),
        "--data",
        str(data),
        "--steps",
        "3",
        "--batch",
        "4",
        "--max-len",
        "32",
        "--rate",
        "3",
        "--rank",
        "4",
        "--threads",
        "1",
        "--lr",
        "0.02",
        "--warmup",
        "1",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    out = tmp_path / "o2"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        "29613",
        "-m",
        "m2r2",
        *args,
        "--out",
        str(out),
    ]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    from m2r2.loading import load_model

    lm = load_model(tmp_path / "m", torch.float32, kernel="plain")
    runs = {2: load_adapters(out / "adapters.safetensors", lm.model, lm.fingerprint).state_dict()}
    one = train(
        lm.model,
        FastConfig.build(6, rate=3, rank=4),
        recs,
        settings(tmp_path / "o1", steps=3, gamma_max=6, warmup=1, lr=0.02, max_len=32),
        lm.fingerprint,
    )
    runs[1] = one["stream"].state_dict()
    # two processes with half batches each and averaged gradients follow the one-process run
    # (the adapters; ARLA's position subsamples are drawn per process, so it differs)
    for k, v in runs[1].items():
        if k.startswith("adapters."):
            torch.testing.assert_close(runs[2][k], v, atol=2e-2, rtol=2e-2)
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in runs[2].items() if ".B." in k)
