"""Defects a new user hits on a first try (issue 12): each answered by a one-line error or the right behaviour."""

from __future__ import annotations

import inspect
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from m2r2 import loading
from m2r2.cli import build_parser, main
from m2r2.errors import InputError, SettingsError, WeightsError


@pytest.fixture(autouse=True)
def _no_model_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("M2R2_MODEL", raising=False)


@pytest.fixture(scope="module")
def tiny_dir(tiny_model) -> Path:
    return tiny_model(arch="llama", seed=3)


def one_line_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("m2r2: error: "), (rc, err)
    assert out == ""
    return lines[0]


# --------------------------------------------------------------------------- the model cache


@pytest.fixture
def fake_gguf(tmp_path: Path, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch):
    """A 'GGUF' whose de-quantization copies the tiny model (counts conversions)."""
    monkeypatch.setenv("M2R2_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "Tiny.gguf"
    gguf.write_bytes(b"GGUF-tiny")
    calls: list[Path] = []

    def dequantize(src: Path, out: Path) -> None:
        calls.append(src)
        for f in tiny_dir.iterdir():
            if f.name != loading.FINGERPRINT_FILE:
                shutil.copy(f, out / f.name)

    monkeypatch.setattr(loading, "_dequantize", dequantize)
    return gguf, calls


def _flip_bytes(path: Path, keep_mtime: bool) -> None:
    st = path.stat()
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = bytes(b ^ 0xFF for b in data[mid : mid + 64])
    path.write_bytes(bytes(data))
    assert path.stat().st_size == st.st_size
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("keep_mtime", [True, False], ids=["same-mtime", "new-mtime"])
def test_damaged_cached_weights_are_converted_again_or_named(fake_gguf, keep_mtime: bool) -> None:
    gguf, calls = fake_gguf
    target = loading.resolve_model(gguf, quiet=True)
    assert len(calls) == 1 and loading.resolve_model(gguf, quiet=True) == target and len(calls) == 1
    good = loading.fingerprint(target)
    _flip_bytes(target / "model.safetensors", keep_mtime)
    with pytest.raises(WeightsError, match=re.escape(f"delete the folder {target}")):
        loading.load_model(target, torch.float32, kernel="plain")
    assert loading.resolve_model(gguf, quiet=True) == target and len(calls) == 2  # converted again
    assert loading.fingerprint(target) == good


def test_first_run_notice_goes_to_stderr(fake_gguf, capsys: pytest.CaptureFixture[str]) -> None:
    gguf, _ = fake_gguf
    loading.resolve_model(gguf, quiet=False)
    out, err = capsys.readouterr()
    assert out == "" and "de-quantizing" in err


def test_unwritable_cache_fails_before_converting(fake_gguf, tmp_path: Path, monkeypatch) -> None:
    gguf, calls = fake_gguf
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("M2R2_CACHE", str(blocker / "cache"))
    with pytest.raises(SettingsError, match="M2R2_CACHE"):
        loading.resolve_model(gguf, quiet=True)
    assert calls == []


def test_stale_conversion_folders_are_cleaned(fake_gguf, tmp_path: Path) -> None:
    gguf, _ = fake_gguf
    models = tmp_path / "cache" / "models"
    dead = models / ".tmp-999999999-abc"  # no such process: a conversion killed midway
    live = models / f".tmp-{os.getpid()}-xyz"  # a conversion running now
    for d in (dead, live):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"x" * 10)
    loading.resolve_model(gguf, quiet=True)
    assert not dead.exists() and live.exists()


# --------------------------------------------------------------------------- prompts, options, threads


def test_invalid_utf8_prompt(capsys, monkeypatch: pytest.MonkeyPatch, tiny_dir: Path) -> None:
    bad = b"caf\xe9 \xff".decode("utf-8", "surrogateescape")  # what Python makes of such argv bytes
    line = one_line_error(capsys, "generate", bad, "--model", str(tiny_dir), "--dtype", "fp32")
    assert "UTF-8" in line
    stdin = io.TextIOWrapper(io.BytesIO(b"caf\xe9 \xff\n"), encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", stdin)
    line = one_line_error(capsys, "generate", "-", "--model", str(tiny_dir), "--dtype", "fp32")
    assert "UTF-8" in line


@pytest.fixture(scope="module")
def engine(tiny_dir: Path):
    from m2r2 import Engine

    return Engine(model=tiny_dir, dtype="fp32", quiet=True)


@pytest.mark.parametrize(
    ("method", "options", "name"),
    [
        ("early-exit-spec", {"max_draft": "abc"}, "max_draft"),
        ("early-exit-spec", {"max_draft": -3}, "max_draft"),
        ("early-exit-spec", {"stop_below": 1.5}, "stop_below"),
        ("lookahead", {"window": 0}, "window"),
        ("lookahead", {"ngram": 2.5}, "ngram"),
        ("calm", {"threshold": -0.1}, "threshold"),
        ("calm", {"max_pending": 0}, "max_pending"),
        ("m2r2-dynamic", {"backoff": -1}, "backoff"),
        ("m2r2", {"adaptive": "maybe"}, "adaptive"),
    ],
)
def test_method_options_are_checked(engine, method: str, options: dict, name: str) -> None:
    with pytest.raises(SettingsError, match=f"^{name} must be"):
        engine.strategy(method, **options)


def test_bad_option_on_the_command_line(capsys, tiny_dir: Path) -> None:
    argv = ["generate", "hi", "--model", str(tiny_dir), "--dtype", "fp32", "--method", "early-exit-spec"]
    assert "max_draft" in one_line_error(capsys, *argv, "--option", "max_draft=abc")
    assert "max_draft" in one_line_error(capsys, *argv, "--option", "max_draft=-3")


def test_too_many_threads_are_capped(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from m2r2 import Engine
    from m2r2.machine import available_cores

    before = torch.get_num_threads()
    try:
        Engine(model=tiny_dir, dtype="fp32", threads=999, quiet=True)
        assert torch.get_num_threads() == available_cores() < 999
        assert "999" in capsys.readouterr().err
    finally:
        torch.set_num_threads(before)


# --------------------------------------------------------------------------- defaults a user relies on


def test_engine_is_exported_and_shares_the_cli_default_method() -> None:
    from m2r2 import Engine
    from m2r2.engine import DEFAULT_METHOD

    for fn in (Engine.chat, Engine.generate_ids):
        assert inspect.signature(fn).parameters["method"].default == DEFAULT_METHOD
    args = build_parser().parse_args(["generate", "hi"])
    assert args.method == DEFAULT_METHOD == "auto"


def test_one_default_path_for_distilled_answers() -> None:
    p = build_parser()
    written = p.parse_args(["distill-data"]).out
    for argv in (["train"], ["train-mod"], ["draft-vocab"], ["moefy"]):
        assert p.parse_args(argv).data == written, argv


def test_moefication_falls_back_to_shipped_conversations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from m2r2.moe import moefy
    from m2r2.paths import shipped_conversations

    if shipped_conversations() is None:
        pytest.skip("the project's shared/data/train is not reachable from here")
    monkeypatch.chdir(tmp_path)  # a fresh clone: no runs/ folder
    data = moefy.calibration_data(Path("runs/distill/answers.jsonl"))
    assert data.is_file() and data.name == "conversations.jsonl"
    with pytest.raises(InputError, match=r"no-such\.jsonl"):
        moefy.calibration_data(Path("no-such.jsonl"), fallback=())


# --------------------------------------------------------------------------- bench output


def _bench(tiny_dir: Path, out: Path, *extra: str) -> list[str]:
    return ["bench", "--model", str(tiny_dir), "--dtype", "fp32", "--methods", "vanilla", "--dataset", "builtin",
            "--max-new-tokens", "3", "--warmup", "0", "--out", str(out), *extra]  # fmt: skip


def test_bench_out_checked_before_any_work(capsys, monkeypatch, tiny_dir: Path, tmp_path: Path) -> None:
    from m2r2.bench import harness

    def no_work(*a, **k):
        raise AssertionError("the benchmark ran before its output folder was checked")

    monkeypatch.setattr(harness, "run_one", no_work)
    afile = tmp_path / "results-file"
    afile.write_text("")
    for out in (afile, afile / "sub"):
        assert str(out) in one_line_error(capsys, *_bench(tiny_dir, out, "--limit", "1"))


def test_interrupted_bench_keeps_what_it_measured(capsys, monkeypatch, tiny_dir: Path, tmp_path: Path) -> None:
    from m2r2.bench import harness

    real, calls = harness.answer, []

    def answer_then_interrupt(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(harness, "answer", answer_then_interrupt)
    out = tmp_path / "bench"
    assert main(_bench(tiny_dir, out, "--limit", "4")) == 130
    saved = json.loads((out / "results.json").read_text())
    assert len(saved["prompts"]) == 2 and saved["complete"] is False


def test_results_are_stamped_with_commit_and_command(tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench"
    assert main(_bench(tiny_dir, out, "--limit", "1")) == 0
    saved = json.loads((out / "results.json").read_text())
    assert saved["complete"] is True and saved["command"].startswith("m2r2 bench")
    assert "commit" in saved and "commit" in (out / "results.md").read_text()


# --------------------------------------------------------------------------- the dynamic suite's size


def test_dynamic_suite_default_sweep_is_small_and_honours_dataset() -> None:
    from m2r2.bench import dynamic_suite as ds
    from m2r2.bench.harness import BenchSettings

    small, full = ds.default_sweeps(full=False), ds.default_sweeps(full=True)
    count = lambda s: sum(len(v) for _, v in s.values())  # noqa: E731
    assert count(small) <= 10 < count(full)
    settings = BenchSettings(dataset="mt_bench", methods=[], limit=3, max_new_tokens=64, out_dir=Path("x"))
    assert ds.suite_datasets(settings) == ["mt_bench"]
    settings.dataset = None
    assert ds.suite_datasets(settings) == list(ds.DATASETS)


def test_the_gpu_script_parses_and_names_its_steps() -> None:
    """`scripts/gpu_stream.sh` is what a session with a lent GPU runs first, with minutes of device time: it must at
    least parse, and without a step print its calls rather than do anything (its dry run, ~4 minutes, is not a test)."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_stream.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    assert out.returncode == 2
    for step in ("pack", "slim", "device-load", "device-train", "unslim", "dry-run"):
        assert f"gpu_stream.sh {step}" in out.stderr
