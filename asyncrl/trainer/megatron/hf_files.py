"""HF model directories on disk: lazy tensor reads and sharded safetensors writes.

Owns: reading one tensor at a time from a HF checkpoint (single file or sharded with an index),
so no rank ever holds a whole large model in host memory, and writing a HF directory
(`config.json`, `model-0000i-of-0000n.safetensors`, `model.safetensors.index.json`) from a
stream of (name, tensor) pairs, so an export needs one shard of memory at a time.

Does not own: names or layouts (`convert.py`), who writes (the trainer's writer rank).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from asyncrl.trainer.megatron.errors import ConversionError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class HFReader:
    """`reader(name)` -> the whole tensor `name` of the checkpoint in `path` (on CPU)."""

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        if (self.path / INDEX).exists():
            weight_map = json.loads((self.path / INDEX).read_text())["weight_map"]
        elif (self.path / SINGLE).exists():
            weight_map = None
        else:
            raise ConversionError(f"{self.path}: no {SINGLE} or {INDEX} (only safetensors load)")
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE]
        self._handles = {f: safe_open(str(self.path / f), framework="pt") for f in files}
        if weight_map is None:
            weight_map = {k: SINGLE for k in self._handles[SINGLE].keys()}
        self._where: dict[str, str] = weight_map

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __call__(self, name: str) -> torch.Tensor:
        try:
            return self._handles[self._where[name]].get_tensor(name)
        except KeyError:
            raise ConversionError(f"{self.path}: checkpoint has no tensor {name!r}") from None


def write_hf(
    path: str | Path,
    tensors: Iterable[tuple[str, torch.Tensor]],
    hf_config: Any,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 4 << 30,
) -> Path:
    """Write a HF model directory from (name, tensor) pairs; returns the directory.

    Tensors are moved to CPU (and cast to `dtype` when given) as they arrive and flushed into a
    new shard whenever `max_shard_bytes` would be exceeded.
    """
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    files: list[str] = []
    cur: dict[str, torch.Tensor] = {}
    cur_bytes = 0

    def flush() -> None:
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(cur, str(out / name), metadata={"format": "pt"})
        files.append(name)

    weight_map: dict[str, int] = {}
    total = 0
    for name, t in tensors:
        t = t.detach().to("cpu", dtype=dtype or t.dtype).contiguous()
        nbytes = t.numel() * t.element_size()
        if cur and cur_bytes + nbytes > max_shard_bytes:
            flush()
            cur, cur_bytes = {}, 0
        cur[name] = t
        cur_bytes += nbytes
        weight_map[name] = len(files)
        total += nbytes
    flush()
    n = len(files)
    if n == 1:
        (out / files[0]).rename(out / SINGLE)
    else:
        final = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for old, new in zip(files, final, strict=True):
            (out / old).rename(out / new)
        index = {"metadata": {"total_size": total},
                 "weight_map": {k: final[i] for k, i in sorted(weight_map.items())}}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    if dtype is not None:
        # transformers 5 names the field `dtype`; older versions `torch_dtype`.
        setattr(hf_config, "dtype" if "dtype" in vars(hf_config) else "torch_dtype", dtype)
    hf_config.save_pretrained(out)
    return out
