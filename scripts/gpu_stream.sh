#!/usr/bin/env bash
# The seeded fast stream trained on a lent GPU with the CPU recipe's own commands (distill-data -> store ->
# train-seeded; docs/TRAINING.md, "Forty-eighth round"), in the `device` tool's limits: 15 minutes of one H100/H200
# in all, at most 64 MiB sent a call (tracked tree, carried paths), 10 minutes a command, a machine kept warm only
# ~30 s after a call. Why a script: those minutes go on the run, not on finding out what the machine lacks.
#
#   here:  scripts/gpu_stream.sh pack     .gpu/: the bundled GGUF in two halves, its sha256, the gguf wheel (the
#                                          device image lacks it), the training prompts (../shared does not travel)
#          scripts/gpu_stream.sh slim     benchmarks/ and the adapters the run does not read moved to
#                                          ../m2r2-offtree, so that the tree sent is ~12 MB; prints what travels
#   device run 1, carry [".gpu/gguf.part00"]:
#          bash scripts/gpu_stream.sh device-load
#   device run 2 at once (the half above lives in the warm machine's /tmp only),
#          carry [".gpu/gguf.part01", ".gpu/whl", ".gpu/prompts.jsonl", ".gpu/gguf.sha256"], timeout_s 590:
#          bash scripts/gpu_stream.sh device-train [DISTILL_MIN STORE_MIN TRAIN_MIN]   (default 4.5 1 2.5)
#          -> $OUT: adapters.safetensors + .json (the stream), log.txt, summary.txt
#   here:  scripts/gpu_stream.sh unslim   everything back (git status as before)
#          then eval-align / bench the returned adapters as any others (--adapters, --option m2r2@gpu:adapters=...)
#   here:  scripts/gpu_stream.sh dry-run  device-load + device-train on this CPU with tiny budgets (the same code
#                                          path but CUDA): what to run before spending device time
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PACK=.gpu
OFFTREE=${M2R2_OFFTREE:-$ROOT/../m2r2-offtree}
WORK=${M2R2_GPU_WORK:-/tmp/m2r2-gpu}
PY=${PYTHON:-python3}
SEEDED=src/m2r2/adapters/smollm2-135m-seeded.safetensors

say() { echo "gpu_stream: $*" >&2; }

travels() {  # bytes the device tool would send: tracked and untracked-not-ignored files present, plus carried paths
  { git ls-files -co --exclude-standard -z | xargs -0 -r stat -c %s 2>/dev/null; for p in "$@"; do find "$p" -type f -exec stat -c %s {} +; done; } |
    awk '{s += $1} END {printf "%.1f", s / 1048576}'
}

pack() {
  local gguf
  gguf=$(.venv/bin/python -c "from m2r2.loading import bundled_gguf; print(bundled_gguf())")
  mkdir -p "$PACK/whl"
  grep -qxF "/$PACK/" .git/info/exclude 2>/dev/null || echo "/$PACK/" >>.git/info/exclude
  rm -f "$PACK"/gguf.part*
  split -n 2 -d "$gguf" "$PACK/gguf.part"
  sha256sum "$gguf" | cut -d' ' -f1 >"$PACK/gguf.sha256"
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform any -d "$PACK/whl" \
    "gguf==$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("gguf"))')"
  cp "${M2R2_SHARED:-$ROOT/../shared}/data/train/prompts.jsonl" "$PACK/prompts.jsonl"
  ls -la "$PACK" "$PACK/whl" >&2
}

slim() {
  mkdir -p "$OFFTREE/adapters"
  [ -d benchmarks ] && mv benchmarks "$OFFTREE/"
  for f in src/m2r2/adapters/*; do
    case $f in "${SEEDED%.safetensors}".*) ;; *) mv "$f" "$OFFTREE/adapters/" ;; esac
  done
  say "sends $(travels "$PACK/gguf.part00") MiB with part 1, $(travels "$PACK/gguf.part01" "$PACK/whl" "$PACK/prompts.jsonl" "$PACK/gguf.sha256") MiB with part 2 (limit 64)"
}

unslim() {
  [ -d "$OFFTREE/benchmarks" ] && mv "$OFFTREE/benchmarks" .
  if [ -d "$OFFTREE/adapters" ]; then mv "$OFFTREE"/adapters/* src/m2r2/adapters/ 2>/dev/null || true; rmdir "$OFFTREE/adapters"; fi
  rmdir "$OFFTREE" 2>/dev/null || true
  git status --short -- benchmarks src/m2r2/adapters >&2
}

device_load() {
  mkdir -p "$WORK"
  cp "$PACK/gguf.part00" "$WORK/"
  say "part 1 in $WORK ($(du -sh "$WORK/gguf.part00" | cut -f1))"
}

device_train() {
  local distill_min=${1:-4.5} store_min=${2:-1} train_min=${3:-2.5}
  local out=${OUT:?OUT (the device tool sets it) names where results go}
  local device=${M2R2_GPU_DEVICE:-cuda}
  mkdir -p "$out"
  exec > >(tee "$out/log.txt") 2>&1
  cat "$WORK/gguf.part00" "$PACK/gguf.part01" >"$WORK/model.gguf"
  echo "$(cat "$PACK/gguf.sha256")  $WORK/model.gguf" | sha256sum -c -
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$PACK"/whl/*.whl
  export PYTHONPATH="$WORK/site:$ROOT/src" M2R2_CACHE="${M2R2_GPU_CACHE:-$WORK/cache}" PYTHONUNBUFFERED=1
  local model=(--model "$WORK/model.gguf" --device "$device")
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  SECONDS=0
  "$PY" -m m2r2 distill-data "${model[@]}" --prompts "$PACK/prompts.jsonl" --out "$WORK/answers.jsonl" --limit 0 \
    --batch "${M2R2_GPU_BATCH:-256}" --max-new-tokens 256 --minutes "$distill_min"
  local t_distill=$SECONDS
  "$PY" -m m2r2 store "${model[@]}" --data "$WORK/answers.jsonl" --out "$WORK/store" --kv-layers 1 --max-len 256 \
    --batch "${M2R2_GPU_STORE_BATCH:-64}" --minutes "$store_min"
  local t_store=$((SECONDS - t_distill))
  "$PY" -m m2r2 train-seeded "${model[@]}" --store "$WORK/store" --init "$SEEDED" --draft-vocab "$SEEDED" --rank 128 \
    --oov flat --bf16 --lr 5e-4 --warmup 5 --holdout "${M2R2_GPU_HOLDOUT:-48}" --batch "${M2R2_GPU_TRAIN_BATCH:-64}" \
    --minutes "$train_min" --out "$WORK/seeded"
  cp "$WORK/seeded/adapters.safetensors" "$WORK/seeded/adapters.json" "$out/"
  {
    echo "answers $(wc -l <"$WORK/answers.jsonl") in ${t_distill} s; store ${t_store} s; training $((SECONDS - t_distill - t_store)) s"
    "$PY" -c "import json; print(json.dumps(json.load(open('$out/adapters.json'))['train'], indent=1))" | head -60
  } | tee "$out/summary.txt"
}

case ${1:-} in
  pack) pack ;;
  slim) slim ;;
  unslim) unslim ;;
  device-load) device_load ;;
  device-train) shift; device_train "$@" ;;
  dry-run)
    M2R2_GPU_WORK=$(mktemp -d)
    export M2R2_GPU_WORK PYTHON=$ROOT/.venv/bin/python M2R2_GPU_DEVICE=cpu M2R2_GPU_BATCH=16 M2R2_GPU_STORE_BATCH=8 \
      M2R2_GPU_TRAIN_BATCH=4 M2R2_GPU_HOLDOUT=4 OUT=${OUT:-$M2R2_GPU_WORK/out}
    bash "$0" device-load && bash "$0" device-train 0.3 0.3 0.3
    ;;
  *) sed -n '2,25p' "$0" >&2; exit 2 ;;
esac
