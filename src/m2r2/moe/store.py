"""Slow memory: every expert of an MoE model in one safetensors file, read one expert at a time.

The file is written once per model and dtype (:meth:`ExpertStore.write`); reading an expert is real
file I/O: the byte range of its two tensors, known from the safetensors header, is read with
``os.preadv`` straight into a preallocated destination (a fast-memory cache slot on a CPU, a pinned
staging buffer on a GPU), with no intermediate allocation. That is how a runtime on a phone or a PC
streams experts from flash / host memory, so the measured read times are honest I/O (usually served
by the OS page cache here, i.e. a memory copy: which is why a bandwidth can also be *modelled*, see
:mod:`m2r2.moe.loader`).

The header is parsed and checked by us (offsets inside the file, sizes matching shapes and dtypes,
every expert present), and a CRC-32 of each expert is stored in the metadata and checked when the
store is opened with ``verify=True``, so a truncated or corrupt file fails with a clear
:class:`~m2r2.errors.WeightsError` before decoding starts instead of producing garbage experts.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from m2r2.errors import WeightsError
from m2r2.files import atomic_write

FORMAT = "m2r2-experts"
#: safetensors dtype names of the dtypes we store.
DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
Key = tuple[int, int]  # (layer, expert)


def tensor_name(layer: int, expert: int, part: str) -> str:
    return f"layers.{layer}.experts.{expert}.{part}"


def _bytes_of(t: Tensor) -> memoryview:
    """Writable byte view of a contiguous CPU tensor (no copy)."""
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def _crc(w13: Tensor, w2: Tensor) -> int:
    return zlib.crc32(_bytes_of(w2.contiguous()), zlib.crc32(_bytes_of(w13.contiguous())))


@dataclass(frozen=True)
class ExpertLayout:
    """Byte ranges (absolute file offsets) of one expert's two tensors."""

    w13: tuple[int, int]
    w2: tuple[int, int]


class ExpertStore:
    """Read-only access to an expert file: shapes, dtype, and :meth:`read_into` one expert."""

    def __init__(self, path: str | os.PathLike[str], verify: bool = True) -> None:
        self.path = Path(path)
        try:
            self.fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise WeightsError(f"expert file {self.path} cannot be opened: {e}") from e
        try:
            self._parse()
            if verify:
                self.verify()
        except BaseException:
            os.close(self.fd)
            raise

    # ------------------------------------------------------------------ writing

    @staticmethod
    def write(
        path: str | os.PathLike[str],
        experts: Mapping[Key, tuple[Tensor, Tensor]],
        info: Mapping[str, str] | None = None,
    ) -> Path:
        """Write ``{(layer, expert): (w13, w2)}`` atomically (temp file + rename); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors: dict[str, Tensor] = {}
        crcs: dict[str, int] = {}
        for (layer, e), (w13, w2) in sorted(experts.items()):
            w13, w2 = w13.detach().cpu().contiguous(), w2.detach().cpu().contiguous()
            tensors[tensor_name(layer, e, "w13")] = w13
            tensors[tensor_name(layer, e, "w2")] = w2
            crcs[f"{layer}.{e}"] = _crc(w13, w2)
        meta = {"format": FORMAT, "crc32": json.dumps(crcs), **(info or {})}
        return atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))

    # ------------------------------------------------------------------ reading

    def _parse(self) -> None:
        size = os.fstat(self.fd).st_size
        head = os.pread(self.fd, 8, 0)
        if len(head) < 8:
            raise WeightsError(f"expert file {self.path} is truncated (no safetensors header)")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 1 << 28):
            raise WeightsError(f"expert file {self.path} is truncated or corrupt (header length {n}, file {size} B)")
        try:
            header = json.loads(os.pread(self.fd, n, 8))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise WeightsError(f"expert file {self.path} has a corrupt header: {e}") from e
        if not isinstance(header, dict):
            raise WeightsError(f"expert file {self.path} has a corrupt header")
        meta = header.pop("__metadata__", {}) or {}
        if meta.get("format") != FORMAT:
            raise WeightsError(f"{self.path} is not an m2r2 expert file")
        self.info: dict[str, str] = meta
        base = 8 + n
        spans: dict[str, tuple[int, int]] = {}
        dtypes, shapes = set(), {}
        for name, t in header.items():
            try:
                dtype = DTYPES.get(t.get("dtype"))
                begin, end = (int(x) for x in t["data_offsets"])
                shape = tuple(int(s) for s in t["shape"])
                _, layer, _, e, part = name.split(".")
                int(layer), int(e)
            except (AttributeError, KeyError, TypeError, ValueError) as e:
                raise WeightsError(f"expert file {self.path} has a corrupt header entry {name!r}: {e}") from e
            if dtype is None:
                raise WeightsError(f"expert file {self.path}: {name} has unsupported dtype {t.get('dtype')}")
            if end - begin != _numel(shape) * dtype.itemsize or begin < 0 or base + end > size:
                raise WeightsError(
                    f"expert file {self.path} is truncated or corrupt: {name} spans bytes {base + begin}..{base + end} "
                    f"of a {size}-byte file"
                )
            spans[name] = (base + begin, base + end)
            dtypes.add(dtype)
            shapes[part] = shape
        if len(dtypes) != 1 or set(shapes) != {"w13", "w2"}:
            raise WeightsError(f"expert file {self.path} mixes dtypes or lacks w13/w2 tensors")
        self.dtype: torch.dtype = dtypes.pop()
        self.w13_shape: tuple[int, ...] = shapes["w13"]
        self.w2_shape: tuple[int, ...] = shapes["w2"]
        self.layout: dict[Key, ExpertLayout] = {}
        for name in spans:
            _, layer, _, e, part = name.split(".")
            if part == "w13":
                key = (int(layer), int(e))
                w2 = spans.get(tensor_name(*key, "w2"))
                if w2 is None:
                    raise WeightsError(f"expert file {self.path} lacks {tensor_name(*key, 'w2')}")
                self.layout[key] = ExpertLayout(spans[name], w2)
        for name in spans:  # every tensor, of either name, must belong to an expert with the same shapes
            _, layer, _, e, part = name.split(".")
            expected = self.w13_shape if part == "w13" else self.w2_shape
            if (int(layer), int(e)) not in self.layout or spans[name][1] - spans[name][0] != _numel(
                expected
            ) * self.dtype.itemsize:
                raise WeightsError(f"expert file {self.path}: {name} does not match the other experts")
        try:
            self.crc: dict[str, int] = {k: int(v) for k, v in json.loads(meta.get("crc32", "{}")).items()}
        except (json.JSONDecodeError, TypeError, ValueError, AttributeError) as e:
            raise WeightsError(f"expert file {self.path} has corrupt checksums: {e}") from e

    @property
    def keys(self) -> list[Key]:
        return sorted(self.layout)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert (w13 + w2)."""
        return (_numel(self.w13_shape) + _numel(self.w2_shape)) * self.dtype.itemsize

    def _pread_into(self, span: tuple[int, int], dst: memoryview) -> None:
        begin, end = span
        done = 0
        while done < end - begin:
            n = os.preadv(self.fd, [dst[done:]], begin + done)
            if n <= 0:
                raise WeightsError(f"expert file {self.path} is truncated (short read at byte {begin + done})")
            done += n

    def read_into(self, key: Key, w13: Tensor, w2: Tensor) -> int:
        """Read expert ``key`` into the contiguous CPU tensors ``w13`` and ``w2``; returns bytes read."""
        lay = self.layout.get(key)
        if lay is None:
            raise WeightsError(f"expert file {self.path} has no expert {key[1]} of layer {key[0]}")
        self._pread_into(lay.w13, _bytes_of(w13))
        self._pread_into(lay.w2, _bytes_of(w2))
        return self.expert_bytes

    def read(self, key: Key) -> tuple[Tensor, Tensor]:
        """A freshly allocated copy of expert ``key`` (tests, tools)."""
        w13 = torch.empty(self.w13_shape, dtype=self.dtype)
        w2 = torch.empty(self.w2_shape, dtype=self.dtype)
        self.read_into(key, w13, w2)
        return w13, w2

    def verify(self) -> None:
        """Check every expert's CRC-32 against the one stored at write time (one pass over the file)."""
        if len(self.crc) != len(self.layout):
            raise WeightsError(f"expert file {self.path} lacks checksums for some experts")
        for key in self.keys:
            w13, w2 = self.read(key)
            if _crc(w13, w2) != self.crc.get(f"{key[0]}.{key[1]}"):
                raise WeightsError(
                    f"expert file {self.path} is corrupt: expert {key[1]} of layer {key[0]} fails its checksum"
                )

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> ExpertStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            self.close()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
