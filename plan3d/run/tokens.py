"""Token files for `plan3d launch --data`: a corpus as one flat array of token ids.

Two formats, both read through a read-only memory map (nothing is copied until a batch is cut):
- nanoGPT's `.bin` (karpathy/nanoGPT, data/*/prepare.py): the token ids of the whole corpus one
  after another, little-endian uint16, no header. A vocabulary over 65,536 ids needs uint32: name
  such a file `*.u32.bin`.
- Megatron-LM's indexed dataset (megatron/core/datasets/indexed_dataset.py): `PREFIX.bin` with
  `PREFIX.idx` beside it. The .idx header is the magic `MMIDIDX\\x00\\x00`, a little-endian u64
  version (1) and a u8 dtype code; the .bin holds every document's tokens back to back. Documents
  are read as one stream (as nanoGPT does), so a sequence may cross a document boundary.

A step's global batch is `batch` windows of seq + 1 tokens at offsets drawn from a generator
seeded by (seed, step) alone, so every layout trains on the same sequences in the same order, and
data-parallel rank d takes rows [d*G/dp, (d+1)*G/dp), exactly as with the synthetic stream.
numpy only: the launcher checks a file before any rank starts, without torch.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from plan3d.errors import SpecError

BUNDLED = Path(__file__).parents[1] / "bundled" / "data"
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
                   7: np.float32, 8: np.uint16}


def megatron_dtype(idx: Path) -> np.dtype:
    """The token dtype named by a Megatron .idx header."""
    head = idx.read_bytes()[:18]
    if len(head) < 18 or head[:9] != MEGATRON_MAGIC:
        raise SpecError(str(idx), ["not a Megatron indexed-dataset index (no MMIDIDX header)"])
    code = head[17]
    dtype = MEGATRON_DTYPES.get(code)
    if dtype is None or not np.issubdtype(dtype, np.integer):
        raise SpecError(str(idx), [f"token dtype code {code} is not an integer type"])
    return np.dtype(dtype)


def token_dtype(path: Path) -> np.dtype:
    """uint16 (nanoGPT), uint32 for `*.u32.bin`, or what the Megatron .idx beside it says."""
    idx = path.with_suffix(".idx")
    if idx.exists():
        return megatron_dtype(idx)
    return np.dtype("<u4") if path.name.endswith(".u32.bin") else np.dtype("<u2")


def bundled_names() -> list[str]:
    return sorted(p.stem for p in BUNDLED.glob("*.bin"))


def resolve_token_file(name_or_path: str | Path) -> Path:
    """A token file's path: the path itself, or a bundled corpus by name (`python-docs`)."""
    path = Path(name_or_path)
    if path.is_file():
        return path.resolve()
    bundled = BUNDLED / f"{name_or_path}.bin"
    if bundled.is_file():
        return bundled
    raise SpecError(str(name_or_path), [f"no such token file or bundled corpus ({', '.join(bundled_names())}); "
                                        "give a nanoGPT .bin or a Megatron PREFIX.bin"])


def map_tokens(name_or_path: str | Path, window: int) -> np.ndarray:
    """The corpus as a read-only memory map, its size checked (whole tokens, at least one window)
    but its ids not scanned: what a rank opens after the launcher ran `open_tokens`."""
    path = resolve_token_file(name_or_path)
    dtype = token_dtype(path)
    if path.stat().st_size % dtype.itemsize:
        raise SpecError(str(path), [f"size {path.stat().st_size} B is not a whole number of {dtype} tokens"])
    if path.stat().st_size < window * dtype.itemsize:
        raise SpecError(str(path), [f"needs at least {window} tokens (sequence length + 1) for one sequence"])
    return np.memmap(path, dtype=dtype, mode="r")


def token_file_record(name_or_path: str | Path) -> dict:
    """What summary.json says of a token file: its absolute path, token count and format."""
    path = resolve_token_file(name_or_path)
    dtype = token_dtype(path)
    megatron = path.with_suffix(".idx").exists()
    return {"path": str(path), "tokens": path.stat().st_size // dtype.itemsize,
            "format": f"megatron-indexed ({dtype.name})" if megatron else f"nanogpt-bin ({dtype.name})"}


def open_tokens(name_or_path: str | Path, vocab: int, window: int) -> np.ndarray:
    """The corpus as a read-only array, checked: long enough for a window, ids below `vocab`."""
    tokens = map_tokens(name_or_path, window)
    path = Path(tokens.filename)
    top, low = int(tokens.max()), int(tokens.min())
    if low < 0 or top >= vocab:
        raise SpecError(str(path), [f"token ids span {low}..{top}, outside the model's vocabulary 0..{vocab - 1}; "
                                    "tokenize for this model or use a model spec with a larger vocab"])
    return tokens


def window_offsets(seed: int, step: int, batch: int, window: int, length: int) -> np.ndarray:
    """Start offsets of the `batch` windows of step `step`: a function of (seed, step) alone."""
    rng = np.random.default_rng([seed, step])
    return rng.integers(0, length - window + 1, size=batch)


def global_windows(tokens: np.ndarray, seed: int, step: int, batch: int, seq: int) -> np.ndarray:
    """[batch, seq + 1] int64 token ids of step `step` (inputs = [:, :-1], targets = [:, 1:])."""
    window = seq + 1
    offsets = window_offsets(seed, step, batch, window, len(tokens))
    return np.stack([np.asarray(tokens[o:o + window], dtype=np.int64) for o in offsets])


def write_tokens(path: str | Path, ids) -> Path:
    """Write ids as a nanoGPT .bin (uint16; uint32 when the name ends in .u32.bin)."""
    path = Path(path)
    dtype = np.dtype("<u4") if path.name.endswith(".u32.bin") else np.dtype("<u2")
    array = np.asarray(ids)
    if array.size and (array.min() < 0 or array.max() > np.iinfo(dtype).max):
        raise SpecError(str(path), [f"token ids do not fit {dtype}; name the file *.u32.bin"])
    array.astype(dtype).tofile(path)
    return path
