"""The command line: help, ``generate`` output formats, and one-line errors with exit code 2."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT, copy_model, edit_config
from m2r2.cli import main


@pytest.fixture(autouse=True)
def _no_model_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("M2R2_MODEL", raising=False)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()  # drop what fixtures printed
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc: int, out: str, err: str, match: str = "") -> None:
    lines = err.strip().splitlines()
    assert rc == 2, (rc, err)
    assert len(lines) == 1, f"expected one error line, got:\n{err}"
    assert lines[0].startswith("m2r2: error: "), lines[0]
    assert "Traceback" not in err
    assert match.lower() in lines[0].lower()
    assert out == ""


# --------------------------------------------------------------------------- help


@pytest.mark.parametrize(
    ("argv", "expect"),
    [
        (["--help"], ["generate", "chat", "bench"]),
        (["generate", "--help"], ["--max-new-tokens", "--temperature", "--top-p", "--method", "auto", "--json"]),
        (["--version"], ["m2r2 0."]),
        (["bench", "--help"], ["--fresh-turns", "--suite", "--methods"]),
    ],
)
def test_help(capsys: pytest.CaptureFixture[str], argv: list[str], expect: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for word in expect:
        assert word in out


# --------------------------------------------------------------------------- generate


@pytest.fixture(scope="module")
def tiny_dir(tiny_model) -> Path:
    return tiny_model(arch="llama", seed=3)


def test_generate_json(capsys: pytest.CaptureFixture[str], tiny_dir: Path) -> None:
    rc, out, err = run_cli(
        capsys, "generate", "Write a short poem about the sea.", "--model", str(tiny_dir), "--dtype", "fp32",
        "--max-new-tokens", "8", "--json",
    )  # fmt: skip
    assert rc == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1
    d = json.loads(lines[0])
    assert {"text", "new_tokens", "seconds", "tokens_per_s", "method"} <= set(d)
    assert d["method"] == "vanilla" and 0 <= d["new_tokens"] <= 8 and d["seconds"] > 0
    assert isinstance(d["text"], str) and d["tokens_per_s"] >= 0


def test_generate_streamed_text_equals_json_text(capsys: pytest.CaptureFixture[str], tiny_dir: Path) -> None:
    common = ["generate", "How can I improve my time management skills?", "--model", str(tiny_dir)]
    common += ["--dtype", "fp32", "--max-new-tokens", "12"]
    rc, out, _ = run_cli(capsys, *common, "--json")
    assert rc == 0
    text = json.loads(out)["text"]
    rc, streamed, err = run_cli(capsys, *common)
    assert rc == 0
    assert streamed == text + "\n"
    assert "tok/s" in err and "[vanilla]" in err  # default method ``auto``: no adapters for this model
    rc, plain, _ = run_cli(capsys, *common, "--no-stream")
    assert rc == 0 and plain == text + "\n"


def test_chat_keeps_the_conversations_cache_until_reset(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tiny_dir: Path
) -> None:
    """`m2r2 chat`: a second turn prefills only its new message (the summary says how many prompt tokens
    were cached); after /reset a turn prefills its whole prompt again."""
    lines = iter(["Name a colour.", "And another?", "/reset", "Name a fruit.", "/quit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    rc, _, err = run_cli(capsys, "chat", "--model", str(tiny_dir), "--dtype", "fp32", "--max-new-tokens", "6")
    assert rc == 0, err
    turns = [line for line in err.splitlines() if line.startswith("[vanilla]")]
    assert len(turns) == 3
    assert "cached" not in turns[0] and "prompt tokens cached" in turns[1] and "cached" not in turns[2]


def test_bench_parses_fresh_turns() -> None:
    from m2r2.cli import build_parser

    assert build_parser().parse_args(["bench", "--fresh-turns"]).fresh_turns is True
    assert build_parser().parse_args(["bench"]).fresh_turns is False


def test_generate_default_dtype_and_sampling(capsys: pytest.CaptureFixture[str], tiny_dir: Path) -> None:
    argv = ["generate", "Hello there", "--model", str(tiny_dir), "--max-new-tokens", "6", "--json"]
    argv += ["--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "5"]
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 0, err
    first = json.loads(out)
    rc, out, _ = run_cli(capsys, *argv)
    assert json.loads(out)["text"] == first["text"]


def test_generate_reads_stdin(capsys, monkeypatch: pytest.MonkeyPatch, tiny_dir: Path) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello world"))
    rc, out, _ = run_cli(
        capsys, "generate", "-", "--model", str(tiny_dir), "--dtype", "fp32", "--max-new-tokens", "3", "--json"
    )
    assert rc == 0 and json.loads(out)["new_tokens"] <= 3


# --------------------------------------------------------------------------- errors


@pytest.fixture(scope="module")
def broken_models(tiny_model, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tiny_model(arch="llama", seed=3)
    root = tmp_path_factory.mktemp("broken")
    out: dict[str, Path] = {}
    out["no-config"] = copy_model(base, root / "no-config")
    (out["no-config"] / "config.json").unlink()
    out["truncated"] = copy_model(base, root / "truncated")
    w = out["truncated"] / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    out["gpt2"] = copy_model(base, root / "gpt2")
    edit_config(out["gpt2"], model_type="gpt2")
    out["rope"] = copy_model(base, root / "rope")
    edit_config(out["rope"], rope_parameters={"rope_type": "longrope", "factor": 2.0, "rope_theta": 10000.0})
    return out


@pytest.mark.parametrize(
    ("which", "match"),
    [
        ("no-config", "config.json"),
        ("truncated", "corrupt or truncated"),
        ("gpt2", "gpt2"),
        ("rope", "longrope"),
    ],
)
def test_bad_model_errors(capsys, broken_models: dict[str, Path], which: str, match: str) -> None:
    rc, out, err = run_cli(capsys, "generate", "hi", "--model", str(broken_models[which]), "--dtype", "fp32")
    assert_one_line_error(rc, out, err, match)


def test_missing_model_path(capsys, tmp_path: Path) -> None:
    rc, out, err = run_cli(capsys, "generate", "hi", "--model", str(tmp_path / "nowhere" / "model"))
    assert_one_line_error(rc, out, err, "does not exist")
    rc, out, err = run_cli(capsys, "generate", "hi", "--model", "no-such-model-name")
    assert_one_line_error(rc, out, err, "unknown model")


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--temperature", "-1"], "temperature"),
        (["--temperature", "nan"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--top-p", "1.5"], "top_p"),
        (["--top-k", "-3"], "top_k"),
        (["--max-new-tokens", "0"], "max_new_tokens"),
        (["--stop", ""], "stop"),
        (["--temperature", "1", "--seed", str(2**70)], "seed"),
        (["--method", "nope"], "unknown method"),
        (["--threads", "-1"], "threads"),
        (["--option", "foo=1"], "takes no option foo"),
        (["--option", "novalue"], "KEY=VALUE"),
        (["--method", "lookahead", "--option", "window=40"], "exceeds"),
        (["--method", "lookahead", "--temperature", "0.5"], "greedy only"),
        (["--method", "m2r2"], "no adapters ship"),
        (["--threshold", "0.5"], "--method m2r2-dynamic"),
    ],
    ids=lambda v: "_".join(v).lstrip("-") if isinstance(v, list) else None,
)
def test_bad_settings(capsys, tiny_dir: Path, args: list[str], match: str) -> None:
    rc, out, err = run_cli(capsys, "generate", "hi", "--model", str(tiny_dir), "--dtype", "fp32", *args)
    assert_one_line_error(rc, out, err, match)


@pytest.mark.parametrize("prompt", ["", "   "])
def test_empty_prompt(capsys, tiny_dir: Path, prompt: str) -> None:
    rc, out, err = run_cli(capsys, "generate", prompt, "--model", str(tiny_dir), "--dtype", "fp32")
    assert_one_line_error(rc, out, err, "empty")


def test_empty_stdin(capsys, monkeypatch: pytest.MonkeyPatch, tiny_dir: Path) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n"))
    rc, out, err = run_cli(capsys, "generate", "-", "--model", str(tiny_dir))
    assert_one_line_error(rc, out, err, "empty")


def test_prompt_longer_than_context(capsys, tiny_model) -> None:
    d = tiny_model(arch="llama", max_position_embeddings=64)
    rc, out, err = run_cli(capsys, "generate", "tell me a story " * 40, "--model", str(d), "--dtype", "fp32")
    assert_one_line_error(rc, out, err, "context window is 64")


def test_installed_script_error_in_subprocess(tmp_path: Path) -> None:
    """The console script itself: a user error is one line on stderr, exit code 2, no traceback."""
    exe = Path(sys.executable).parent / "m2r2"
    if not exe.exists():
        exe = REPO_ROOT / ".venv" / "bin" / "m2r2"
    if not exe.exists():
        pytest.skip("m2r2 console script is not installed")
    missing = tmp_path / "missing-model"
    proc = subprocess.run(
        [str(exe), "generate", "hello", "--model", str(missing)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "M2R2_CACHE": str(tmp_path / "cache")},
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [f"m2r2: error: model path {missing} does not exist"]


# --------------------------------------------------------------------------- draft-vocab


def test_draft_vocab_writes_a_checked_vocabulary(capsys, tiny_dir: Path, tmp_path: Path) -> None:
    from m2r2.engine import Engine
    from m2r2.multirate.fast import FastConfig, FastStream
    from m2r2.multirate.io import load_adapters, save_adapters

    engine = Engine(str(tiny_dir), dtype="fp32", quiet=True)
    model = engine.model
    stream = FastStream(model, FastConfig.build(model.cfg.num_layers, depth=1, rank=2))
    src = save_adapters(tmp_path / "a.safetensors", stream, engine.fingerprint, steps=3)
    data = tmp_path / "answers.jsonl"
    data.write_text("".join(json.dumps({"prompt_ids": [1], "answer_ids": [5, 5, 5, 7, 9, 9]}) + "\n" for _ in range(3)))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"turns": ["hello hello hello"]}) + "\n")
    out = tmp_path / "b.safetensors"
    argv = ["draft-vocab", "--model", str(tiny_dir), "--dtype", "fp32", "--adapters", str(src)]
    rc, stdout, err = run_cli(
        capsys, *argv, "--data", str(data), "--prompts", str(prompts), "--size", "6", "--out", str(out)
    )
    assert rc == 0, err
    assert json.loads(stdout)["draft_vocab"] == 6
    vocab = load_adapters(out, model, engine.fingerprint).draft_vocab.tolist()
    assert len(vocab) == 6 and {5, 7, 9} <= set(vocab) and set(engine.tokenizer.eos_ids) <= set(vocab)
    assert json.loads(out.with_suffix(".json").read_text())["steps"] == 3  # provenance carried over
    rc, stdout, err = run_cli(capsys, *argv, "--data", str(tmp_path / "missing.jsonl"), "--out", str(out))
    assert_one_line_error(rc, stdout, err, "distill-data")


def test_draft_vocab_rewrites_medusa_and_eagle_heads(capsys, tiny_dir: Path, tmp_path: Path) -> None:
    """Every tree drafter's file takes a draft vocabulary: Medusa heads and an EAGLE head too."""
    from m2r2.decoding.eagle import EagleConfig, EagleHead, load_head, save_head
    from m2r2.decoding.medusa import MedusaConfig, MedusaHeads, load_heads, save_heads
    from m2r2.engine import Engine

    engine = Engine(str(tiny_dir), dtype="fp32", quiet=True)
    model, fp = engine.model, engine.fingerprint
    data = tmp_path / "answers.jsonl"
    data.write_text(json.dumps({"prompt_ids": [1], "answer_ids": [5, 5, 7, 9]}) + "\n")
    files = {
        "medusa": (
            save_heads(
                tmp_path / "m.safetensors",
                MedusaHeads(model, MedusaConfig.build(model.cfg.hidden_size, 2)),
                fp,
                note="m",
            ),
            load_heads,
        ),
        "eagle": (
            save_head(
                tmp_path / "e.safetensors",
                EagleHead(model, EagleConfig.build(model.cfg.num_layers, model.cfg.hidden_size)),
                fp,
                note="e",
            ),
            load_head,
        ),
    }
    for name, (src, load) in files.items():
        rc, _, err = run_cli(
            capsys, "draft-vocab", "--model", str(tiny_dir), "--dtype", "fp32", "--adapters", str(src),
            "--data", str(data), "--prompts", "", "--size", "4",
        )  # fmt: skip
        assert rc == 0, err
        vocab = load(src, model, fp).draft_vocab.tolist()
        assert len(vocab) == 4 and {5, 7, 9} <= set(vocab), name
        assert json.loads(src.with_suffix(".json").read_text())["note"] == name[0]  # provenance carried over
