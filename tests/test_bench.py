"""Benchmark datasets and harness: loading and validation, then one small real run end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from m2r2.bench import datasets
from m2r2.bench.datasets import DatasetError, load_dataset
from m2r2.bench.harness import BenchSettings, run_bench
from m2r2.errors import SettingsError, UnknownNameError

ROWS = [
    {"id": "a", "source": "t", "category": "math", "turns": ["What is 3 times 4?"]},
    {"id": 7, "source": "t", "category": None, "turns": ["Name a fruit.", "Now name a vegetable."]},
]


def _write(path: Path, rows: list[dict] | list[str]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


class Untouchable:
    """An engine stand-in that fails if the harness uses it before validating its settings."""

    def __getattr__(self, name: str):
        raise AssertionError(f"engine.{name} used before settings were validated")


# --------------------------------------------------------------------------- datasets


def test_builtin_set() -> None:
    data = load_dataset("builtin")
    assert len(data.prompts) >= 10
    assert len({p.id for p in data.prompts}) == len(data.prompts)
    assert sum(len(p.turns) == 2 for p in data.prompts) >= 2
    assert len(load_dataset("builtin", limit=3).prompts) == 3
    assert len(load_dataset("builtin", limit=0).prompts) == len(data.prompts)


def test_load_by_path_and_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path / "mine.jsonl", ROWS)
    data = load_dataset(str(path))
    assert data.name == "mine"
    assert [(p.id, p.category, p.turns) for p in data.prompts] == [
        ("a", "math", ("What is 3 times 4?",)),
        ("7", None, ("Name a fruit.", "Now name a vegetable.")),
    ]
    # by name: found through $M2R2_SHARED (the shared dir), ahead of any ../shared
    eval_dir = tmp_path / "shared" / "data" / "eval"
    eval_dir.mkdir(parents=True)
    _write(eval_dir / "mt_bench.jsonl", ROWS)
    monkeypatch.setenv("M2R2_SHARED", str(tmp_path / "shared"))
    data = load_dataset("mt_bench", limit=1)
    assert (data.name, data.path, [p.id for p in data.prompts]) == ("mt_bench", eval_dir / "mt_bench.jsonl", ["a"])


def test_real_shared_mt_bench_has_two_turns() -> None:
    if datasets.shared_eval_dir() is None:
        pytest.skip("no shared/data/eval here")
    data = load_dataset("mt_bench")
    assert len(data.prompts) > 10 and all(len(p.turns) == 2 for p in data.prompts)


def test_builtin_fallback_without_shared(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(datasets, "shared_eval_dir", lambda: None)
    data = load_dataset("koala")
    assert data.name == "builtin (for koala)"
    assert data.prompts == load_dataset("builtin").prompts
    assert "M2R2_SHARED" in capsys.readouterr().err


def test_unknown_dataset_lists_valid_names() -> None:
    with pytest.raises(UnknownNameError, match=r"mt_bench.*builtin"):
        load_dataset("mt-bench")


@pytest.mark.parametrize(
    ("lines", "match"),
    [
        ([json.dumps(ROWS[0]), '{"id": "b", "turns": ["x"'], r"bad\.jsonl:2: not valid JSON"),
        ([json.dumps({"id": "b", "turns": []})], r":1: 'turns' must be a non-empty list"),
        ([json.dumps({"id": "b", "prompt": "hello"})], r":1: 'turns'"),
        ([json.dumps({"turns": ["hi"]})], r":1: 'id'"),
        (["[1, 2]"], r":1: expected a JSON object"),
        (["", "  "], "holds no prompts"),
    ],
)
def test_malformed_jsonl_is_a_clear_error(tmp_path: Path, lines: list[str], match: str) -> None:
    path = _write(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DatasetError, match=match):
        load_dataset(str(path))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="no such prompt file"):
        load_dataset(str(tmp_path / "nope.jsonl"))


# --------------------------------------------------------------------------- harness


def _settings(tmp_path: Path, **kw) -> BenchSettings:
    base = dict(dataset="builtin", methods=["vanilla"], limit=1, max_new_tokens=4, out_dir=tmp_path / "out")
    return BenchSettings(**{**base, **kw})


def test_stamp_names_the_path_switches_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run with a switch that picks other code paths (the same tokens, other timings) says so in its command."""
    from types import SimpleNamespace

    from m2r2.bench.results import PATH_SWITCHES, environment

    fake = SimpleNamespace(dtype_name="bf16", kernel="q4-avx2", device="cpu", model_dir=tmp_path)
    settings = _settings(tmp_path, command="m2r2 bench --suite dynamic")
    for name in PATH_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert environment(fake, settings)["command"] == "m2r2 bench --suite dynamic"  # type: ignore[arg-type]
    monkeypatch.setenv("M2R2_NO_GREEDY_PASS", "1")
    assert environment(fake, settings)["command"] == "M2R2_NO_GREEDY_PASS=1 m2r2 bench --suite dynamic"  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"methods": ["vanilla", "nope"]}, r"unknown method.*nope"),
        ({"dataset": "nope"}, "unknown dataset 'nope'"),
        ({"suite": "no-such-suite"}, "unknown suite 'no-such-suite'; available: paper, dynamic, moe"),
    ],
)
def test_names_are_checked_before_any_work(tmp_path: Path, kw: dict, match: str) -> None:
    with pytest.raises(UnknownNameError, match=match):
        run_bench(Untouchable(), _settings(tmp_path, **kw))  # type: ignore[arg-type]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"medusa": {"max_nodes": 4}}, r"--option for method\(s\) not in this run: medusa"),
        ({"vanilla": {"adapters": "x"}}, "method 'vanilla' takes no option adapters"),
    ],
)
def test_method_options_are_checked_before_any_work(tmp_path: Path, options: dict, match: str) -> None:
    with pytest.raises(SettingsError, match=match):
        run_bench(Untouchable(), _settings(tmp_path, options=options))  # type: ignore[arg-type]
    assert not (tmp_path / "out").exists()


def test_bench_option_names_its_method() -> None:
    from m2r2.cli import _scoped_options
    from m2r2.errors import M2R2Error

    assert _scoped_options(["m2r2:adapters=a.safetensors", "m2r2:width=3", "medusa:max_nodes=4"]) == {
        "m2r2": {"adapters": "a.safetensors", "width": 3},
        "medusa": {"max_nodes": 4},
    }
    with pytest.raises(M2R2Error, match="METHOD:KEY=VALUE"):
        _scoped_options(["adapters=a:b"])


def test_method_variants_and_suite_methods_are_planned_and_checked(tmp_path: Path) -> None:
    """``NAME@LABEL`` runs NAME under options of its own; ``--methods`` replaces a suite's methods."""
    from m2r2.bench.harness import method_of, plan, run_options

    assert method_of("m2r2@nolookup") == "m2r2" and method_of("vanilla") == "vanilla"
    settings = _settings(tmp_path, dataset=None, methods=[], suite="paper")
    assert [d for d, _ in plan(settings)] == ["mt_bench", "koala", "self_instruct", "wizardlm"]
    assert all("eagle" in m and "m2r2@nolookup" in m for _, m in plan(settings))
    assert run_options({}, plan(settings)) == {"m2r2@nolookup": {"lookup": 0}}  # the ablation row's own option
    assert run_options({"m2r2@nolookup": {"lookup": 2}}, plan(settings))["m2r2@nolookup"] == {"lookup": 2}
    settings.methods = ["vanilla", "m2r2", "m2r2@nolookup"]
    assert all(m == ["vanilla", "m2r2", "m2r2@nolookup"] for _, m in plan(settings))
    with pytest.raises(SettingsError, match="takes no option bogus"):  # a variant's options are its method's
        run_bench(Untouchable(), _settings(tmp_path, methods=["vanilla", "m2r2@x"], options={"m2r2@x": {"bogus": 1}}))  # type: ignore[arg-type]
    with pytest.raises(UnknownNameError, match="nope@x"):
        run_bench(Untouchable(), _settings(tmp_path, methods=["vanilla", "nope@x"]))  # type: ignore[arg-type]
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def engine(real_engine):
    return real_engine


@pytest.mark.slow
def test_run_bench_end_to_end(engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, list[dict[str, str]], str]] = []
    chat = engine.chat

    def spy(messages, method="vanilla", gen=None, **kw):
        out = chat(messages, method=method, gen=gen, **kw)
        calls.append((method, [dict(m) for m in messages], out.text))
        return out

    monkeypatch.setattr(engine, "chat", spy)
    path = _write(tmp_path / "two.jsonl", ROWS)
    settings = _settings(tmp_path, dataset=str(path), methods=["vanilla", "hf", "hf-pld"], limit=0, max_new_tokens=12)
    res = run_bench(engine, settings)

    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    for key in (
        "dataset", "n_prompts", "max_new_tokens", "dtype", "kernel", "threads", "torch_version",
        "transformers_version", "cpu", "device", "model", "date", "command", "methods", "prompts",
    ):  # fmt: skip
        assert key in saved, key
    assert (saved["dataset"], saved["n_prompts"], saved["max_new_tokens"], saved["dtype"]) == ("two", 2, 12, "fp32")
    assert saved["model"] == engine.model_dir.name
    methods = saved["methods"]
    assert list(methods) == ["vanilla", "hf", "hf-pld"]
    for name, m in methods.items():
        assert m["identical"] == 1.0, name  # fp32 greedy: transformers and PLD match vanilla exactly
        assert m["tokens_per_s"] > 0 and m["total_seconds"] > 0 and 0 < m["mean_new_tokens"] <= 24
        assert m["forward_passes"] >= 1  # numeric stats averaged per method
    assert methods["vanilla"]["speedup"] == 1.0 and methods["vanilla"]["layers_per_token"] == 30
    assert all(m["speedup_ci"] is None for m in methods.values())  # 2 prompts: too few for a 95% interval
    assert "mean_accepted" in methods["hf-pld"]

    two_turn = saved["prompts"][1]
    assert (two_turn["id"], two_turn["turns"]) == ("7", 2)
    for name in methods:
        row = two_turn["methods"][name]
        assert len(row["ids"]) == 2 and row["tokens"] == sum(map(len, row["ids"]))
    # later turns carry the cache by default; transformers' methods ignore it and prefill in full
    assert saved["fresh_turns"] is False
    assert two_turn["methods"]["vanilla"]["stats"][1]["prompt_reused"] > 0
    assert two_turn["methods"]["hf"]["stats"][1]["prompt_reused"] == 0
    # the second turn sees the method's own first answer; warm-up (1 prompt x 3 methods) came first
    timed = calls[3:]
    assert len(timed) == 3 * 3
    for method in methods:
        first, second = [
            (msgs, text) for m, msgs, text in timed if m == method and msgs[0]["content"] == "Name a fruit."
        ]
        assert second[0][1] == {"role": "assistant", "content": first[1]}

    md = (tmp_path / "out" / "results.md").read_text()
    assert "fp32" in md.splitlines()[0] and "| two | hf-pld |" in md
    assert res["markdown"] == md and "markdown" not in saved
    assert (tmp_path / "out" / "speed.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_suite_report_plots_each_dataset(tmp_path: Path) -> None:
    """A suite's report has one plot per dataset besides the overview; a single run has only the overview."""
    from m2r2.bench.report import write_report

    def row(dataset: str, method: str, tps: float) -> dict:
        return {
            "dataset": dataset,
            "method": method,
            "tokens_per_s": tps,
            "speedup": tps / 10,
            "identical": 1.0,
            "mean_new_tokens": 5.0,
            "total_seconds": 1.0,
        }

    env = {
        "model": "m",
        "cpu": "c",
        "device": "cpu",
        "threads": 1,
        "dtype": "fp32",
        "kernel": "dense",
        "torch_version": "t",
        "transformers_version": "t",
        "n_prompts": 2,
        "max_new_tokens": 4,
        "date": "d",
    }
    methods = {f"{d}/{m}": row(d, m, t) for d in ("koala", "wizardlm") for m, t in (("vanilla", 10.0), ("m2r2", 12.0))}
    md = write_report({**env, "dataset": "koala, wizardlm", "methods": methods}, tmp_path)
    assert "| koala | m2r2 |" in md and "| wizardlm | vanilla |" in md
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["speed.png", "speed_koala.png", "speed_wizardlm.png"]
    single = tmp_path / "single"
    single.mkdir()
    write_report({**env, "dataset": "koala", "methods": {"vanilla": row("koala", "vanilla", 10.0)}}, single)
    assert [p.name for p in single.glob("*.png")] == ["speed.png"]


def test_each_prompt_starts_one_method_later() -> None:
    """Interleaving rotates the method order prompt by prompt (a slow method's after-effects, or the
    first run after a prompt switch, do not always land on the same method); results keep the given order."""
    from types import SimpleNamespace

    from m2r2.bench.datasets import Dataset, Prompt
    from m2r2.bench.harness import run_one
    from m2r2.decoding.base import GenerationConfig, GenerationResult

    calls: list[tuple[str, str]] = []

    class Recorder:
        def strategy(self, method: str, **options):
            return None

        def chat(self, messages, method: str, gen, **options):
            calls.append((messages[-1]["content"], method))
            return SimpleNamespace(text="x", result=GenerationResult([1, 2], 0.1, "length", 1))

    methods = ["vanilla", "m2r2", "medusa"]
    data = Dataset("d", Path("d.jsonl"), [Prompt(str(i), "s", None, (f"p{i}",)) for i in range(4)])
    summary, rows = run_one(Recorder(), data, methods, GenerationConfig(max_new_tokens=2), 0)  # type: ignore[arg-type]
    firsts = [m for i, (prompt, m) in enumerate(calls) if i % 3 == 0]
    assert firsts == ["vanilla", "m2r2", "medusa", "vanilla"]
    assert [list(r["methods"]) for r in rows] == [methods] * 4 and list(summary) == methods
    assert all(r["methods"]["medusa"]["speedup"] == 1.0 for r in rows)


def test_report_table_puts_the_drafting_counts_beside_the_timings() -> None:
    from m2r2.bench.report import markdown_table

    base = {
        "dataset": "d",
        "tokens_per_s": 30.0,
        "speedup": 1.0,
        "identical": 1.0,
        "mean_new_tokens": 9.0,
        "total_seconds": 2.0,
    }
    results = {
        "methods": {
            "vanilla": {**base, "method": "vanilla"},
            "m2r2": {**base, "method": "m2r2", "mean_accepted": 1.5, "acceptance_rate": 0.25,
                     "copied_accepted_per_token": 0.125, "drafting_share": 0.375, "draft_cost": 0.1},
        }
    }  # fmt: skip
    lines = markdown_table(results).splitlines()
    assert [c.strip() for c in lines[0].strip("|").split("|")][3:5] == ["speedup", "95% CI"]
    assert [c.strip() for c in lines[0].strip("|").split("|")][7:12] == [
        "mean accepted", "acceptance", "copied/token", "drafted", "draft cost",
    ]  # fmt: skip
    assert "| - | - | - | - | - |" in lines[2] and "| 1.50 | 0.25 | 0.12 | 0.38 | 0.10 |" in lines[3]
    assert "| 1.00x | - | 100% |" in lines[3]  # no interval given: none shown
    results["methods"]["m2r2"]["speedup_ci"] = [0.91, 1.24]
    assert "| 1.00x | 0.91-1.24 | 100% |" in markdown_table(results).splitlines()[3]


def test_median_interval_is_the_sign_test_s_and_covers_as_it_says() -> None:
    """The order statistics of the distribution-free interval (k = 6 of 20 at 95%: P(Bin(20, 1/2) <= 5) = 0.0207),
    none under 6 values, and its coverage of a skewed distribution's median over many samples is the level it
    promises (0.9586 at 20 values), not less."""
    import random

    from m2r2.bench.intervals import median_interval

    assert median_interval(range(1, 21)) == (6, 15)
    assert median_interval([3.0, 1.0, 2.0, 6.0, 5.0, 4.0]) == (1.0, 6.0)  # k = 1: 1 - 2 / 64 = 0.969
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None  # 1 - 2 / 32 = 0.9375 < 0.95
    assert median_interval([]) is None
    assert median_interval(range(1, 21), level=0.5) == (8, 13)  # P(Bin(20, 1/2) <= 7) = 0.132, <= 8: 0.252
    with pytest.raises(ValueError, match="level"):
        median_interval([1.0] * 10, level=1.0)
    rng = random.Random(13)
    median = math.log(2.0)  # of the unit exponential
    trials = 4000
    covered = 0
    for _ in range(trials):
        lo, hi = median_interval([rng.expovariate(1.0) for _ in range(20)])  # type: ignore[misc]
        covered += lo <= median <= hi
    assert abs(covered / trials - 0.9586) < 0.015, covered / trials


def test_head_to_head_compares_the_method_under_test_with_each_later_one_prompt_by_prompt() -> None:
    """The table's ratios come from the same prompt's two timings (m2r2 at 1.1x eagle's tokens/s on every prompt
    reads 1.100 with a 1.100 interval), per dataset; a run with one method besides its baseline has none."""
    from m2r2.bench.report import head_to_head

    def row(dataset: str, tps: dict[str, float]) -> dict:
        return {"dataset": dataset, "methods": {m: {"tokens_per_s": t} for m, t in tps.items()}}

    prompts = [row("koala", {"vanilla": 10.0, "m2r2": 11.0 * (1 + i), "eagle": 10.0 * (1 + i)}) for i in range(8)]
    prompts += [row("wizardlm", {"vanilla": 10.0, "m2r2": 9.0 + i, "eagle": 10.0}) for i in range(8)]
    lines = head_to_head({"prompts": prompts}).splitlines()
    assert lines[0].startswith("| dataset | method | against | median ratio of tokens/s | 95% CI |")
    assert lines[2] == "| koala | m2r2 | eagle | 1.100 | 1.100-1.100 | 8 of 8 |"
    # wizardlm: ratios 0.9, 1.0, ..., 1.6 -> median 1.25; k = 1 of 8 at 95% -> 0.9-1.6; faster on 6
    assert lines[3] == "| wizardlm | m2r2 | eagle | 1.250 | 0.900-1.600 | 6 of 8 |"
    assert head_to_head({"prompts": [row("koala", {"vanilla": 1.0, "m2r2": 2.0})]}) == ""
    assert head_to_head({}) == ""
