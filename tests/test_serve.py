"""``m2r2 serve``: the real ``openai`` client and plain HTTP against a server on a free loopback port.

Batched decoding must be lossless: every request served among others gets exactly the tokens
``Engine.generate`` gives it alone, on tiny random models and on the bundled model (whose lone
requests decode with m2r2 speculation and whose concurrent ones share batched steps).
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from m2r2.decoding.base import GenerationConfig
from m2r2.engine import Engine
from m2r2.serve.app import background, build, create_app
from m2r2.serve.protocol import TextStream
from m2r2.serve.scheduler import Scheduler

MODEL = "tiny"


@pytest.fixture(scope="module")
def tiny_engine(tiny_model) -> Engine:
    return Engine(str(tiny_model(seed=3)), quiet=True)  # bf16, default kernels (q4 layers, oneDNN head)


@pytest.fixture(scope="module")
def server(tiny_engine):
    with background(build(tiny_engine, MODEL, "vanilla", max_batch=4, max_queue=8)) as url:
        yield url


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def wait_idle(url: str, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(url + "/health").json()
        if (h["active"] == 0 and h["waiting"] == 0) or time.monotonic() > deadline:
            return h
        time.sleep(0.05)


def long_prompt(engine: Engine, n: int) -> list[int]:
    """Token ids whose greedy answer runs the whole budget ``n`` (no early EOS), to hold a slot."""
    for seed in range(20):
        ids = torch.randint(3, 300, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        if engine.generate_ids(ids, "vanilla", GenerationConfig(max_new_tokens=n)).stop_reason == "max_new_tokens":
            return ids
    pytest.skip("no prompt found whose answer runs the whole budget")


def solo(engine: Engine, ids: list[int], max_tokens: int, method: str = "vanilla", **gen) -> str:
    r = engine.generate_ids(ids, method, GenerationConfig(max_new_tokens=max_tokens, **gen))
    return engine.tokenizer.decode(r.tokens)


# --------------------------------------------------------------------------- the model's batched step


@pytest.mark.parametrize("kernel", ["plain", "mkldnn", "q4", "q4-amx", "q4-avx512", "q4-avx2"])
def test_step_rows_gives_each_sequence_its_lone_step_bits(kernel):
    """Sequences of different lengths and cache capacities in one step: each row = a lone step, K/V too."""
    from conftest import skip_unless_kernel
    from m2r2.kernels import use_kernels
    from test_speculative import tiny_model as random_model

    head_dim = 16 if kernel.startswith("q4-") else 8  # the C++ q4 kernels: widths of 64
    model = random_model(4, dtype=torch.bfloat16, head_dim=head_dim)
    skip_unless_kernel(model, kernel)
    use_kernels(model, kernel)
    g = torch.Generator().manual_seed(0)
    lens, caps = [5, 17, 40], [40, 30, 90]
    with torch.inference_mode():
        batch, alone = [], []
        for n, cap in zip(lens, caps, strict=True):
            prompt = torch.randint(0, 64, (1, n), generator=g)
            for caches in (batch, alone):
                caches.append(model.new_cache(n + cap))
                model(prompt, caches[-1], 0)
        toks = [3, 9, 27]
        for _ in range(4):
            hidden = model.step_rows(toks, batch)
            for b, cache in enumerate(alone):
                h = model.run_layers(model.embed_tokens(torch.tensor([[toks[b]]])), cache, cache.length)
                assert torch.equal(hidden[b], h[0])
            toks = [int(model.head(hidden[b : b + 1])[0, 0].argmax()) for b in range(3)]
        for a, b in zip(batch, alone, strict=True):
            assert a.length == b.length and torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 8), (9, 3, 64)])  # test_speculative's, SmolLM2's
def test_attention_over_several_caches_gives_each_its_lone_bits(dtype, heads, kv_heads, head_dim):
    """Batch items are independent products of a lone step's shape: on this machine that keeps bits."""
    from m2r2.model import batches_requests_exactly

    assert batches_requests_exactly(heads, kv_heads, head_dim, dtype, "cpu", torch.get_num_threads())


@pytest.mark.parametrize("kernel", ["plain", "mkldnn", "q4", "q4-amx", "q4-avx512", "q4-avx2"])
def test_pooled_step_rows_attend_once_per_size_class_with_lone_step_bits(kernel):
    """Five sequences in two size classes of one pool, interleaved: one attention call per class, and
    every row, and every cache, equal to lone steps; also after a sequence leaves mid-way (the last
    one of its class moves into its place)."""
    from conftest import skip_unless_kernel
    from m2r2.decoding.base import cache_capacity
    from m2r2.kernels import use_kernels
    from test_speculative import tiny_model as random_model

    head_dim = 16 if kernel.startswith("q4-") else 8  # the C++ q4 kernels: widths of 64
    model = random_model(4, dtype=torch.bfloat16, head_dim=head_dim)
    skip_unless_kernel(model, kernel)
    use_kernels(model, kernel)
    ctx = model.cfg.max_position_embeddings
    pool = model.new_pool(4)
    g = torch.Generator().manual_seed(0)
    lens = [5, 200, 20, 17, 215]  # capacities 128, 320, 128, 128, 320 for a 30-token budget
    with torch.inference_mode():
        batch, alone = [], []
        for n in lens:
            prompt = torch.randint(0, 64, (1, n), generator=g)
            for caches, new in ((batch, pool.take), (alone, model.new_cache)):
                caches.append(new(cache_capacity(n, 30, ctx)))
                model(prompt, caches[-1], 0)
        assert sorted(c.max_len for c in batch) == [128, 128, 128, 320, 320]
        toks = [3, 9, 27, 1, 2]
        for step in range(6):
            if step == 3:  # the first sequence leaves: the last 128-slot one moves into its item
                pool.give(batch.pop(0))
                alone.pop(0)
                toks.pop(0)
            groups = model.step_groups(batch)
            assert sorted(len(gr.cache.caches) for gr in groups) == ([2, 3] if step < 3 else [2, 2])
            assert all(gr.cache.k is not None for gr in groups)  # pooled: views, no copy
            hidden = model.step_rows(toks, batch)
            for b, cache in enumerate(alone):
                h = model.run_layers(model.embed_tokens(torch.tensor([[toks[b]]])), cache, cache.length)
                assert torch.equal(hidden[b], h[0])
            toks = [int(model.head(hidden[b : b + 1])[0, 0].argmax()) for b in range(len(batch))]
        for a, b in zip(batch, alone, strict=True):  # (the pool stores float32 where attention computes in it per op)
            assert a.length == b.length and torch.equal(a.k, b.k.to(a.k.dtype)) and torch.equal(a.v, b.v.to(a.v.dtype))


def test_text_stream_never_sends_past_a_stop_string():
    text = "abc STOP def"
    ts = TextStream(lambda ids: text[: len(ids)], ["STOP"])
    sent = "".join(ts.feed([0]) for _ in range(len(text)))
    assert "S" not in sent and sent == "abc "[: len(sent)]
    ts.feed([], final=True)
    assert ts.text == "abc "


# --------------------------------------------------------------------------- API on a tiny model


def test_chat_and_completions_streamed_and_not(server, tiny_engine):
    c = client(server)
    assert [m.id for m in c.models.list().data] == [MODEL]
    msgs = [{"role": "user", "content": "hello there, one two three"}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12)
    ids = tiny_engine.tokenizer.encode_chat(msgs)
    assert r.choices[0].message.content == solo(tiny_engine, ids, 12)
    assert r.usage.prompt_tokens == len(ids) and 1 <= r.usage.completion_tokens <= 12
    assert r.model_extra["m2r2"]["method"] == "vanilla"

    chunks = list(
        c.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=12, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == r.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == r.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens

    p = c.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=10)
    ref = solo(tiny_engine, tiny_engine.tokenizer.encode("The quick brown fox"), 10)
    assert p.choices[0].text == ref
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=10, stream=True))  # fmt: skip
    assert streamed == ref


def test_concurrent_requests_are_batched_and_bit_identical(server, tiny_engine):
    """Greedy and seeded sampling, different prompt lengths and budgets, all at once."""
    c = client(server)
    g = torch.Generator().manual_seed(1)
    jobs = []
    for i in range(6):
        ids = torch.randint(3, 300, (4 + 7 * i,), generator=g).tolist()
        gen = {"temperature": 0.8, "seed": i} if i % 3 == 2 else {}
        jobs.append((ids, 8 + 3 * i, gen))

    def ask(job):
        ids, n, gen = job
        return c.completions.create(model=MODEL, prompt=ids, max_tokens=n, **gen).choices[0].text

    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(ask, jobs))
    for (ids, n, gen), text in zip(jobs, got, strict=True):
        assert text == solo(tiny_engine, ids, n, **gen)
    assert wait_idle(server)["peak_batch"] >= 2


def test_concurrent_requests_in_two_size_classes_attend_per_class_and_stay_bit_identical(tiny_model, monkeypatch):
    """Prompts of different lengths in one size class (capacity 128) and in another (320), greedy and
    seeded, all at once: some step attends once per class over several requests; every answer equals
    ``Engine.generate`` alone."""
    eng = Engine(str(tiny_model(seed=3, max_position_embeddings=1024)), quiet=True)
    seen: list[list[int]] = []
    step_groups = eng.model.step_groups

    def recorded(caches):
        groups = step_groups(caches)
        seen.append(sorted(len(gr.cache.caches) for gr in groups))
        return groups

    monkeypatch.setattr(eng.model, "step_groups", recorded)
    g = torch.Generator().manual_seed(2)
    jobs = []
    for i, n in enumerate([6, 30, 40, 180, 200, 230]):  # + 20 tokens + 64 slack: capacities 128 x 3, 320 x 3
        gen = {"temperature": 0.8, "seed": i} if i in (1, 4) else {}
        jobs.append((torch.randint(3, 300, (n,), generator=g).tolist(), 20, gen))
    barrier = threading.Barrier(len(jobs))
    with background(create_app(eng, SlowScheduler(eng, "vanilla", max_batch=8), MODEL)) as url:
        c = client(url)

        def ask(job):
            ids, n, gen = job
            barrier.wait()
            return c.completions.create(model=MODEL, prompt=ids, max_tokens=n, **gen).choices[0].text

        with ThreadPoolExecutor(len(jobs)) as pool:
            got = list(pool.map(ask, jobs))
        assert wait_idle(url)["peak_batch"] >= 4
    for (ids, n, gen), text in zip(jobs, got, strict=True):
        assert text == solo(eng, ids, n, **gen)
    assert any(len(sizes) == 2 and max(sizes) >= 2 for sizes in seen), seen


def _post(url: str, path: str, body, headers=None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=content, headers={"content-type": "application/json", **(headers or {})})


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "needle"),
    [
        ("/v1/chat/completions", b"{not json", 400, None, "not valid JSON"),
        ("/v1/chat/completions", [1, 2], 400, None, "JSON object"),
        ("/v1/chat/completions", {"model": MODEL}, 400, "messages", "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400, "model", "model"),
        ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "model",
         "does not exist"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, 400,
         "messages[0].role", "role"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": -1},
         400, "temperature", "temperature"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400,
         "top_p", "top_p"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
         400, "max_tokens", "max_tokens"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n",
         "n must be 1"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": ["a"] * 5},
         400, "stop", "stop"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": "yes"},
         400, "stream", "stream"),
        ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt", "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [5, 10**6]}, 400, "prompt", "token ids"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 3}, 400, "logprobs", "not supported"),
        ("/v1/completions", {"model": MODEL, "prompt": [7] * 256}, 400, "messages", "256 tokens"),
    ],
)  # fmt: skip
def test_bad_requests_get_openai_errors(server, path, body, status, param, needle):
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["param"] == param and err["type"]


def test_unknown_route_and_method_get_error_objects(server):
    r = httpx.get(server + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = httpx.get(server + "/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client(server).models.retrieve("gpt-4")


def test_api_key_is_enforced(tiny_engine):
    with background(build(tiny_engine, MODEL, "vanilla", api_key="s3cret")) as url:
        with pytest.raises(openai.AuthenticationError, match="incorrect API key"):
            client(url, "wrong").models.list()
        r = _post(url, "/v1/completions", {"model": MODEL, "prompt": "hi"})
        assert r.status_code == 401 and "missing API key" in r.json()["error"]["message"]
        assert client(url, "s3cret").completions.create(model=MODEL, prompt="hi", max_tokens=2).choices
        assert httpx.get(url + "/health").status_code == 200  # health needs no key


def test_full_queue_answers_429_with_retry_after(tiny_engine):
    with background(build(tiny_engine, MODEL, "vanilla", max_batch=1, max_queue=0)) as url:
        body = {"model": MODEL, "prompt": long_prompt(tiny_engine, 200), "max_tokens": 200, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as first:
            lines = first.iter_lines()  # (kept: a dropped iterator closes the stream)
            next(lines)  # the first request holds the only slot
            r = _post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] == "queue_full"
            with pytest.raises(openai.RateLimitError):
                client(url).completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert wait_idle(url)["active"] == 0


class SlowScheduler(Scheduler):
    """A scheduler whose steps take at least ``STEP_S``: a long answer then surely outlives its client."""

    STEP_S = 0.02

    def _batched_step(self, jobs):
        time.sleep(self.STEP_S)
        super()._batched_step(jobs)


def test_disconnect_cancels_and_frees_the_slot(tiny_engine):
    ids = long_prompt(tiny_engine, 200)
    app = create_app(tiny_engine, SlowScheduler(tiny_engine, "vanilla", max_batch=1, max_queue=0), MODEL)
    with background(app) as url:
        body = {"model": MODEL, "prompt": ids, "max_tokens": 200, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            next(lines)
        h = wait_idle(url, timeout=200 * SlowScheduler.STEP_S / 2)  # well before the answer could end
        assert h["active"] == 0 and h["cancelled"] == 1 and h["completed"] == 0
        # the freed slot serves the next request
        assert client(url).completions.create(model=MODEL, prompt="hi", max_tokens=3).choices[0].text is not None
        # a non-streaming client that gives up is cancelled too
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=0.3)
        h = wait_idle(url, timeout=200 * SlowScheduler.STEP_S / 2)
        assert h["active"] == 0 and h["cancelled"] == 2 and h["completed"] == 1, h


class FailOnceScheduler(Scheduler):
    """A scheduler whose first batched step fails (a stand-in for a bug deep in decoding)."""

    failed = False

    def _batched_step(self, jobs):
        if not self.failed:
            self.failed = True
            raise RuntimeError("boom")
        super()._batched_step(jobs)


def test_a_decoding_failure_answers_500_without_traceback_and_the_server_goes_on(tiny_engine):
    app = create_app(tiny_engine, FailOnceScheduler(tiny_engine, "vanilla"), MODEL)
    with background(app) as url:
        r = _post(url, "/v1/completions", {"model": MODEL, "prompt": long_prompt(tiny_engine, 5), "max_tokens": 5})
        assert r.status_code == 500 and "Traceback" not in r.text
        assert r.json()["error"]["type"] == "server_error"
        assert client(url).completions.create(model=MODEL, prompt="hi", max_tokens=3).choices[0].text is not None
        assert wait_idle(url)["failed"] == 1


def test_stop_strings_cut_streamed_and_whole_answers_alike(server, tiny_engine):
    c = client(server)
    ids = tiny_engine.tokenizer.encode("one two three")
    full = solo(tiny_engine, ids, 24)
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    if not stop.strip():
        pytest.skip("no printable stop string in this answer")
    whole = c.completions.create(model=MODEL, prompt=ids, max_tokens=24, stop=stop)
    parts = c.completions.create(model=MODEL, prompt=ids, max_tokens=24, stop=[stop], stream=True)
    assert whole.choices[0].text == "".join(p.choices[0].text for p in parts) == full[: full.find(stop)]
    assert whole.choices[0].finish_reason == "stop"


# --------------------------------------------------------------------------- the bundled model


@pytest.mark.slow
def test_bundled_model_m2r2_alone_and_batched_together_is_lossless(real_engine_bf16, monkeypatch):
    """Default method (m2r2 for the bundled model): a lone request speculates, concurrent ones batch (greedy ones in
    one-call batched steps where the kernel has them); every answer equals ``Engine.generate`` alone with vanilla and
    with m2r2."""
    eng = real_engine_bf16
    fused, steps = [], eng.model.greedy_steps
    monkeypatch.setattr(eng.model, "greedy_steps", lambda *a: (r := steps(*a), fused.append(r is not None))[0])
    prompts = ["What is the capital of France?", "Write a haiku about rain.", "Explain recursion briefly.",
               "List three primes."]  # fmt: skip
    with background(build(eng, "smollm2-135m", "auto", max_batch=4)) as url:
        c = client(url)

        def ask(p: str):
            return c.chat.completions.create(
                model="smollm2-135m", messages=[{"role": "user", "content": p}], max_tokens=20
            )

        alone = ask(prompts[0])
        assert alone.model_extra["m2r2"]["method"] == "m2r2" and alone.model_extra["m2r2"]["speculative_rounds"] > 0
        barrier = threading.Barrier(len(prompts))

        def together(p: str):
            barrier.wait()
            return ask(p)

        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(together, prompts))
        assert wait_idle(url)["peak_batch"] >= 2
    assert fused and all(fused) == (eng.model.greedy_parts() is not None)
    assert alone.choices[0].message.content == answers[0].choices[0].message.content
    for p, a in zip(prompts, answers, strict=True):
        ids = eng.tokenizer.encode_chat([{"role": "user", "content": p}])
        assert a.choices[0].message.content == solo(eng, ids, 20) == solo(eng, ids, 20, "m2r2")


def test_long_contexts_are_served_as_generate_answers_them(real_engine_bf16):
    """Served alone and batched, prompts of ~600 tokens get ``Engine.generate``'s answer: the pool stores keys as a lone
    sequence's cache does where the fused blocks run (with float32 pooled caches these two answers differed, the
    lone ones' attention taking AMX tiles from 448 keys)."""
    from m2r2.bench.datasets import load_dataset

    eng = real_engine_bf16
    fused = eng.model.fused_stack() is not None
    assert (eng.model.new_pool(1).take(64).k.dtype == torch.bfloat16) == fused
    text = " ".join(p.turns[0] for p in load_dataset("mt_bench", 12).prompts)
    prompts = [f"Summarise these requests in one paragraph: {text[:n]}" for n in (3000, 3400)]
    with background(build(eng, "smollm2-135m", "auto", max_batch=2)) as url:
        c = client(url)

        def ask(p: str) -> str:
            messages = [{"role": "user", "content": p}]
            reply = c.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=64)
            return reply.choices[0].message.content

        alone = [ask(p) for p in prompts]
        barrier = threading.Barrier(len(prompts))
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(lambda p: (barrier.wait(), ask(p))[1], prompts))
    for p, a, b in zip(prompts, alone, together, strict=True):
        ids = eng.tokenizer.encode_chat([{"role": "user", "content": p}])
        assert len(ids) > 600
        assert a == b == solo(eng, ids, 64)


# --------------------------------------------------------------------------- command line


def test_serve_kernel_auto_takes_mkldnn_only_for_large_batches_on_amx_without_q4_amx(monkeypatch):
    from m2r2 import amx
    from m2r2.serve import scheduler
    from m2r2.serve.scheduler import MKLDNN_FROM_BATCH, serve_kernel

    monkeypatch.setattr(scheduler, "cpu_has", lambda flag: flag == "amx_bf16")
    big = MKLDNN_FROM_BATCH
    monkeypatch.setattr(amx, "amx_available", lambda: True)
    assert serve_kernel("auto", big, "bf16", "cpu") == "auto"  # q4-amx: flat in rows, fastest at every batch
    monkeypatch.setattr(amx, "amx_available", lambda: False)
    assert serve_kernel("auto", big, "bf16", "cpu") == "mkldnn"
    assert serve_kernel("auto", big - 1, "bf16", "cpu") == "auto"  # the default batch: q4 wins below
    assert serve_kernel("q4", big, "bf16", "cpu") == "q4"  # an explicit choice is kept
    assert serve_kernel("auto", big, "fp32", "cpu") == serve_kernel("auto", big, "bf16", "cuda") == "auto"
    monkeypatch.setattr(scheduler, "cpu_has", lambda flag: False)
    assert serve_kernel("auto", big, "bf16", "cpu") == "auto"


def test_cli_serve_refuses_methods_it_cannot_batch(capsys, tiny_model):
    from m2r2.cli import main

    rc = main(["serve", "--model", str(tiny_model(seed=3)), "--method", "lookahead", "--port", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "vanilla or a self-speculative method" in err[0]


def test_cli_bench_suite_serve_writes_the_results_schema(capsys, tiny_model, tmp_path):
    from m2r2.cli import main

    model = tiny_model(seed=3, max_position_embeddings=1024)  # the builtin prompts need > 256 tiny tokens
    argv = ["bench", "--suite", "serve", "--model", str(model), "--streams", "1,2", "--limit", "2"]
    assert main([*argv, "--max-new-tokens", "4", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    for s in ("1", "2"):
        v = res["serve"][s]
        assert v["tokens_per_s"] > 0 and v["ttft_p50_s"] > 0 and v["errors"] == 0 and v["complete"] == 1.0
        assert v["identical"] == 1.0 and "itl_p95_s" in v
    assert (tmp_path / "results.md").is_file() and (tmp_path / "serve.png").is_file()
    assert "| 2 |" in capsys.readouterr().out


def test_cli_bench_suite_serve_soak_is_bounded_and_reports_lost_answers_and_rss(capsys, tiny_model, tmp_path):
    """A few seconds of the soak (``--soak-minutes 10`` is the real one): mixed traffic, nothing lost."""
    from m2r2.cli import main

    model = tiny_model(seed=3, max_position_embeddings=1024)
    t0 = time.monotonic()
    argv = ["bench", "--suite", "serve", "--model", str(model), "--streams", "4", "--soak-minutes", "0.05"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    assert time.monotonic() - t0 < 60
    res = json.loads((tmp_path / "soak.json").read_text())
    assert res["ok"] and res["completions_lost"] == 0 and res["all_answered"] and not res["failures"]
    assert res["sent"] == sum(t["sent"] for t in res["requests"].values()) > 4
    assert res["server"]["active"] == res["server"]["waiting"] == res["server"]["failed"] == 0
    assert set(res["rss_mib"]) == {"start", "after_warmup", "max_after_warmup", "end"} and res["rss_bound_mib"] > 0
    assert json.loads(capsys.readouterr().out)["ok"]
