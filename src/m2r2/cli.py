"""Command-line interface: argument parsing only; the work happens in the modules it calls."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from m2r2.errors import M2R2Error

DEFAULT_PROMPT_SYSTEM = None


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        default=os.environ.get("M2R2_MODEL"),
        help="bundled model name (default: smollm2-135m, SmolLM2-135M-Instruct), a .gguf file, "
        "or a local HF model directory (config.json + *.safetensors); env M2R2_MODEL",
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
        choices=["auto", "plain", "mkldnn"],
        help="linear-layer kernels: mkldnn = oneDNN pre-packed bf16 (CPU default), plain = torch",
    )
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def _add_gen_args(p: argparse.ArgumentParser, method_default: str = "vanilla") -> None:
    from m2r2.decoding import method_help

    g = p.add_argument_group("generation")
    methods = method_help()
    g.add_argument(
        "--method",
        default=method_default,
        help="decoding method: " + "; ".join(f"{k}: {v}" for k, v in methods.items()),
    )
    g.add_argument("--max-new-tokens", type=int, default=256, help="token budget of the answer (default 256)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1.0 = off)")
    g.add_argument("--seed", type=int, default=None, help="seed for sampling (reproducible output)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--system", default=None, help="system prompt")


def _gen_config(args: argparse.Namespace):  # -> GenerationConfig
    from m2r2.decoding.base import GenerationConfig

    return GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=list(args.stop),
    ).validate()


def _engine(args: argparse.Namespace, quiet: bool = False):  # -> Engine
    from m2r2.engine import Engine

    return Engine(
        model=args.model, dtype=args.dtype, device=args.device, kernel=args.kernel, threads=args.threads, quiet=quiet
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from m2r2.tokenizer import messages_for

    gen = _gen_config(args)
    prompt = args.prompt if args.prompt != "-" else sys.stdin.read()
    if not prompt.strip():
        raise M2R2Error("the prompt is empty")
    engine = _engine(args, quiet=args.json)
    messages = messages_for(prompt, args.system)
    stream = None
    if not args.json and not args.no_stream:
        printed: list[int] = []
        shown = [""]

        def stream(ids: list[int]) -> None:
            printed.extend(ids)
            text = engine.tokenizer.decode(printed)
            # print only what is new; a partial UTF-8 character shows up once complete
            if text.startswith(shown[0]) and not text.endswith("\ufffd"):
                sys.stdout.write(text[len(shown[0]) :])
                sys.stdout.flush()
                shown[0] = text

    out = engine.chat(messages, method=args.method, gen=gen, stream=stream)
    if args.json:
        print(json.dumps(out.to_json(), ensure_ascii=False))
        return 0
    if stream is None:
        print(out.text)
    else:
        print()
    print(out.summary(), file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from m2r2.tokenizer import Message, messages_for

    gen = _gen_config(args)
    engine = _engine(args)
    history: list[Message] = []
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
            continue
        messages = messages_for(line, args.system, history)
        printed: list[int] = []
        shown = [""]

        def stream(ids: list[int]) -> None:
            printed.extend(ids)
            text = engine.tokenizer.decode(printed)
            if text.startswith(shown[0]) and not text.endswith("\ufffd"):
                sys.stdout.write(text[len(shown[0]) :])
                sys.stdout.flush()
                shown[0] = text

        sys.stdout.write("bot> ")
        try:
            out = engine.chat(messages, method=args.method, gen=gen, stream=stream)
        except M2R2Error as e:
            print(f"\nerror: {e}", file=sys.stderr)
            continue
        print()
        print(out.summary(), file=sys.stderr)
        history += [{"role": "user", "content": line}, {"role": "assistant", "content": out.text}]
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from m2r2.bench.harness import BenchSettings, run_bench

    settings = BenchSettings(
        dataset=args.dataset,
        methods=[m.strip() for m in args.methods.split(",") if m.strip()],
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
        out_dir=Path(args.out),
        warmup=args.warmup,
        suite=args.suite,
    )
    engine = _engine(args)
    results = run_bench(engine, settings)
    print(results["markdown"] if "markdown" in results else json.dumps(results, indent=2))
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
        default="mt_bench",
        help="mt_bench, koala, self_instruct, wizardlm, vicuna, spec_bench, builtin, or a JSONL path",
    )
    b.add_argument("--suite", default=None, help="a named set of datasets and methods (see docs)")
    b.add_argument("--methods", default="vanilla,hf,hf-pld", help="comma-separated methods; the first is the baseline")
    b.add_argument("--limit", type=int, default=10, help="number of prompts (default 10; 0 = all)")
    b.add_argument("--max-new-tokens", type=int, default=128, help="token budget per turn (default 128)")
    b.add_argument("--warmup", type=int, default=1, help="warm-up prompts per method, not timed (default 1)")
    b.add_argument("--out", default="bench-out", help="output directory (default bench-out)")
    _add_model_args(b)
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
