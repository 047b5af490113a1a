"""Training prompts for another round of the model's own answers: the first user turn of every conversation in
../shared/data/train/conversations.jsonl, interleaved by source at the thirteenth round's mix (alpaca-style 24%,
FLAN CoT 15%, P3 12%, LIMA/OASST 12%, role-play 10%, GSM8K 8%, code 10%, tool use 3%, self-instruct 2%), each
source read from its end, so that a prefix of the file is not the prompts earlier rounds answered first.

    python experiments/fresh_prompts.py runs/distill/fresh-prompts.jsonl
"""

import json
import sys
from pathlib import Path

from m2r2.training.distill import rebalance

WEIGHTS = {
    "alpaca_5000": 0.12,
    "alpaca_cleaned_1000": 0.05,
    "alpaca_en_demo": 0.05,
    "dpo_en_demo": 0.02,
    "flan_cot": 0.15,
    "p3_t0": 0.12,
    "lima": 0.06,
    "oasst_deepseek_v3": 0.04,
    "oasst_tree": 0.02,
    "gpteacher_roleplay": 0.10,
    "gsm8k": 0.08,
    "gpteacher_codegen": 0.06,
    "code_alpaca": 0.04,
    "gpteacher_toolformer": 0.03,
    "self_instruct_seed": 0.02,
}
items = []
for line in Path("../shared/data/train/conversations.jsonl").read_text().splitlines():
    c = json.loads(line)
    user = [m["content"] for m in c["messages"] if m["role"] == "user"]
    if user:
        items.append(
            {"id": "fresh:" + c["id"], "source": c["source"], "category": c.get("category"), "turns": user[:1]}
        )
out = rebalance(items[::-1], WEIGHTS)  # reversed: each source from its end (rebalance keeps file order within one)
Path(sys.argv[1]).write_text("".join(json.dumps(it) + "\n" for it in out))
print(len(out), "prompts")
