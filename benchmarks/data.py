"""The benchmark's data: a llama-like model of random matrices in several layouts.

Everything is written straight into the server's bucket folder
(``<root>/bench/<dataset>/``), which localbucket serves as objects; with the moto
fallback the folder is uploaded. Datasets are reused across runs while their
stamp (``<dataset>/.ready`` holding the model spec) matches.

Datasets:
  hf/              Hugging Face layout: 2 safetensors shards + index json
  naive_rows4/     what a hand-rolled job saves: rank{k}.safetensors, rows split 4 ways
  naive_zst/       the hf shards, each zstd-compressed whole (``*.safetensors.zst``)
  dcp_full/        torch.distributed.checkpoint, saved by one process
  dcp_rows4/       DCP saved by 4 gloo ranks, every tensor DTensor Shard(0)
  dcp_rows4_zstd/  the same with DCP's ZStandard stream extension
  sc_rows4/        streamckpt saved by 4 gloo ranks, every tensor DTensor Shard(0)
  sc_rows4_zstd/   the same with ``compression="zstd"``
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

DATASETS_SAVED_BY_RANKS = ("dcp_rows4", "dcp_rows4_zstd", "sc_rows4", "sc_rows4_zstd")
SAVE_WORLD = 4
LOAD_COL_WORLD = 2
TP_WORLD = 4
TP_RANK = 1  # scenario (b) measures this rank of a 4-way row split


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B?|B?)\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"bad size {text!r}: use e.g. 16MiB, 256MiB, 1GiB")
    value = float(m.group(1))
    unit = m.group(2).upper().rstrip("B").rstrip("I")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit]
    return int(value * scale)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name: bfloat16, float16, float32

    @property
    def itemsize(self) -> int:
        return {"bfloat16": 2, "float16": 2, "float32": 4}[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True)
class ModelSpec:
    hidden: int
    inter: int
    vocab: int
    layers: int
    seed: int = 1234

    def tensors(self) -> list[TensorSpec]:
        h, i, v, kv = self.hidden, self.inter, self.vocab, self.hidden // 4
        out = [TensorSpec("model.embed_tokens.weight", (v, h), "float16")]
        for n in range(self.layers):
            p = f"model.layers.{n}."
            out += [
                TensorSpec(p + "input_layernorm.weight", (h,), "float32"),
                TensorSpec(p + "self_attn.q_proj.weight", (h, h), "bfloat16"),
                TensorSpec(p + "self_attn.k_proj.weight", (kv, h), "bfloat16"),
                TensorSpec(p + "self_attn.v_proj.weight", (kv, h), "bfloat16"),
                TensorSpec(p + "self_attn.o_proj.weight", (h, h), "bfloat16"),
                TensorSpec(p + "post_attention_layernorm.weight", (h,), "float32"),
                TensorSpec(p + "mlp.gate_proj.weight", (i, h), "bfloat16"),
                TensorSpec(p + "mlp.up_proj.weight", (i, h), "bfloat16"),
                TensorSpec(p + "mlp.down_proj.weight", (h, i), "bfloat16"),
            ]
        out += [
            TensorSpec("model.norm.weight", (h,), "float32"),
            TensorSpec("lm_head.weight", (v, h), "float16"),
        ]
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def key(self) -> str:
        return f"h{self.hidden}-i{self.inter}-v{self.vocab}-l{self.layers}-s{self.seed}"


def model_for_size(size: int) -> ModelSpec:
    """Dimensions (all divisible by 8) and a layer count that land near ``size`` bytes."""
    if size >= 512 << 20:
        h, i, v = 2048, 5632, 32000
    elif size >= 64 << 20:
        h, i, v = 1024, 2816, 16000
    else:
        h, i, v = 256, 704, 4096
    base = ModelSpec(h, i, v, 0)
    per_layer = ModelSpec(h, i, v, 1).nbytes - base.nbytes
    layers = max(1, round((size - base.nbytes) / per_layer))
    return ModelSpec(h, i, v, layers)


# ------------------------------------------------------------------ generation


def make_tensor(spec: ModelSpec, index: int, t: TensorSpec):  # -> torch.Tensor
    import torch

    g = torch.Generator().manual_seed(spec.seed * 100_003 + index)
    x = torch.randn(t.shape, generator=g, dtype=torch.float32)
    if t.name.endswith("layernorm.weight") or t.name.endswith("norm.weight"):
        x = 1.0 + 0.1 * x
    else:
        x = 0.02 * x
    return x.to(getattr(torch, t.dtype))


def hf_shards(spec: ModelSpec, parts: int = 2) -> list[list[TensorSpec]]:
    """Split the tensor list into ``parts`` consecutive groups of about equal bytes."""
    tensors = spec.tensors()
    total = sum(t.nbytes for t in tensors)
    groups: list[list[TensorSpec]] = [[]]
    acc = 0
    for t in tensors:
        if acc >= total * len(groups) / parts and len(groups) < parts:
            groups.append([])
        groups[-1].append(t)
        acc += t.nbytes
    return groups


def hf_file_names(parts: int = 2) -> list[str]:
    return [f"model-{k + 1:05d}-of-{parts:05d}.safetensors" for k in range(parts)]


def tensor_bytes(t: Any) -> memoryview:
    """The raw bytes of a CPU tensor (any dtype), without a copy when contiguous."""
    import torch

    flat = t.contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def crc(t: Any) -> int:
    from crc32c import crc32c

    return int(crc32c(tensor_bytes(t)))


def row_slice(n: int, rank: int, world: int) -> tuple[int, int]:
    step = n // world
    return rank * step, (rank + 1) * step


def expected_views(name: str, x: Any) -> dict[str, Any]:
    """Every slice a scenario checks, keyed by view name."""
    out = {"full": x}
    r0, r1 = row_slice(x.shape[0], TP_RANK, TP_WORLD)
    out[f"rows{TP_RANK}of{TP_WORLD}"] = x[r0:r1]
    for r in range(LOAD_COL_WORLD):
        if x.dim() == 2:
            c0, c1 = row_slice(x.shape[1], r, LOAD_COL_WORLD)
            out[f"cols{r}of{LOAD_COL_WORLD}"] = x[:, c0:c1]
        else:
            out[f"cols{r}of{LOAD_COL_WORLD}"] = x
    return out


def _ready(dirpath: Path, spec: ModelSpec) -> bool:
    stamp = dirpath / ".ready"
    return stamp.is_file() and stamp.read_text() == spec.key()


def _mark(dirpath: Path, spec: ModelSpec) -> None:
    (dirpath / ".ready").write_text(spec.key())


def generate_local(bucket_dir: Path, spec: ModelSpec, *, dcp: bool = True) -> dict[str, Any]:
    """Write every dataset that one process can write (``dcp_full`` only if ``dcp``); returns fingerprints."""
    import safetensors.torch
    import zstandard

    fp_path = bucket_dir / "fingerprints.json"
    hf_dir = bucket_dir / "hf"
    names = hf_file_names()
    names_all = ("hf", "naive_rows4", "naive_zst") + (("dcp_full",) if dcp else ())
    todo = [d for d in names_all if not _ready(bucket_dir / d, spec)]
    if not todo and fp_path.is_file():
        return json.loads(fp_path.read_text())
    for d in names_all:
        (bucket_dir / d).mkdir(parents=True, exist_ok=True)
    fingerprints: dict[str, dict[str, int]] = {}
    rows4: list[dict[str, Any]] = [{} for _ in range(SAVE_WORLD)]
    weight_map: dict[str, str] = {}
    index = 0
    full: dict[str, Any] = {}
    for fname, group in zip(names, hf_shards(spec)):
        tensors = {}
        for t in group:
            x = make_tensor(spec, index, t)
            index += 1
            tensors[t.name] = x
            weight_map[t.name] = fname
            for view, v in expected_views(t.name, x).items():
                fingerprints.setdefault(view, {})[t.name] = crc(v)
            for k in range(SAVE_WORLD):
                r0, r1 = row_slice(x.shape[0], k, SAVE_WORLD)
                rows4[k][t.name] = x[r0:r1].clone()
        safetensors.torch.save_file(tensors, str(hf_dir / fname), metadata={"format": "pt"})
        raw = (hf_dir / fname).read_bytes()
        (bucket_dir / "naive_zst" / f"{fname}.zst").write_bytes(zstandard.ZstdCompressor(level=3, threads=-1).compress(raw))
        full.update(tensors)
    (hf_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": spec.nbytes}, "weight_map": weight_map}, indent=1)
    )
    for k in range(SAVE_WORLD):
        safetensors.torch.save_file(rows4[k], str(bucket_dir / "naive_rows4" / f"rank{k}.safetensors"))
    del rows4
    if dcp:
        import torch.distributed.checkpoint as tdcp

        tdcp.save(full, storage_writer=tdcp.FileSystemWriter(str(bucket_dir / "dcp_full")))
    del full
    fp_path.write_text(json.dumps(fingerprints))
    for d in names_all:
        _mark(bucket_dir / d, spec)
    return fingerprints


def rank_rows_from_hf(bucket_dir: Path, spec: ModelSpec, rank: int, world: int) -> Iterator[tuple[TensorSpec, Any]]:
    """This rank's row block of every tensor, sliced out of the local hf files (mmap)."""
    from safetensors import safe_open

    for fname, group in zip(hf_file_names(), hf_shards(spec)):
        with safe_open(str(bucket_dir / "hf" / fname), framework="pt") as f:
            for t in group:
                r0, r1 = row_slice(t.shape[0], rank, world)
                yield t, f.get_slice(t.name)[r0:r1].clone()


def saved_by_ranks_missing(bucket_dir: Path, spec: ModelSpec) -> list[str]:
    return [d for d in DATASETS_SAVED_BY_RANKS if not _ready(bucket_dir / d, spec)]


def mark_ready(bucket_dir: Path, spec: ModelSpec, names: list[str]) -> None:
    for d in names:
        if (bucket_dir / d).is_dir():
            _mark(bucket_dir / d, spec)


def dataset_bytes(bucket_dir: Path, name: str, suffix: str = "") -> int:
    d = bucket_dir / name
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file() and p.name != ".ready" and p.name.endswith(suffix))


def dataset_files(bucket_dir: Path, name: str) -> list[str]:
    d = bucket_dir / name
    return sorted(
        p.relative_to(bucket_dir).as_posix() for p in d.rglob("*") if p.is_file() and p.name != ".ready"
    )


def spec_to_json(spec: ModelSpec) -> dict[str, Any]:
    return asdict(spec)


def spec_from_json(d: dict[str, Any]) -> ModelSpec:
    return ModelSpec(**d)
