"""A converted copy of each GGUF file, so the second load skips metadata parsing and nibble shuffling.

Parsing a GGUF's tokenizer arrays takes seconds in the `gguf` reader; the converted form (safetensors + JSON) loads in
a fraction of that. Entries are keyed by the file's absolute path, size and mtime, so an edited file is reconverted
(and its older entry removed). `FLASHNEXT_CACHE_DIR=off` disables the cache.
"""

import hashlib
import json
import mmap
import os
import shutil
import sys
import tempfile
import weakref
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer

from .config import ModelConfig
from .errors import UserError
from .precision import Int4Weight
from .sharding import Shard
from .tokenizer import Tokenizer

FORMAT_VERSION = "1"
_INT4_PARTS = ("packed", "scales", "offsets")
_META_KEYS = {"bos_token_id", "eos_token_ids", "add_bos", "chat_template"}
# safetensors' dtype names of what `save` writes
_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I32": torch.int32,
    "I64": torch.int64,
}
_MAPS: list[tuple[weakref.ref, int]] = []  # the entries' file maps in use: (map, first address)


def _root() -> Path | None:
    setting = os.environ.get("FLASHNEXT_CACHE_DIR")
    if setting == "off":
        return None
    return Path(setting) if setting else Path.home() / ".cache" / "flashnext"


def scratch_folder() -> Path | None:
    """Where a backend may keep unnamed files of a run's derived data (on the cache's disk, so their pages can
    leave memory), or None where the cache is off."""
    root = _root()
    return None if root is None else root / "scratch"


def build_folder() -> Path:
    """Where a backend keeps what it compiles for this machine: the cache's `build` folder, or a folder of this
    process's own where the cache is off."""
    global _process_build_folder
    root = _root()
    if root is not None:
        return root / "build"
    if _process_build_folder is None:
        _process_build_folder = Path(tempfile.mkdtemp(prefix="flashnext-build-"))
    return _process_build_folder


_process_build_folder: Path | None = None


def entry_for(path: Path) -> Path | None:
    root = _root()
    if root is None:
        return None
    stat = path.stat()
    key = f"{FORMAT_VERSION}|{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    return root / "gguf" / hashlib.sha256(key.encode()).hexdigest()[:24]


def save(entry: Path, source: Path, config: ModelConfig, weights: dict, tokenizer: Tokenizer) -> None:
    """Write atomically (temp folder + rename) so an interrupted save never leaves a half entry; then remove the
    entries of earlier versions of the same file (a re-downloaded GGUF would otherwise leave a full copy behind)."""
    tmp = entry.with_name(entry.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "source").write_text(str(source.resolve()))
    tensors, groups = {}, {}
    for name, w in weights.items():
        if isinstance(w, Int4Weight):
            for part in _INT4_PARTS:
                tensors[f"{name}#int4.{part}"] = getattr(w, part).contiguous()
            groups[name] = str(w.group_size)
        else:
            tensors[name] = w.contiguous()
    save_file(tensors, str(tmp / "weights.safetensors"), metadata=groups)
    (tmp / "config.json").write_text(config.model_dump_json())
    (tmp / "tokenizer.json").write_text(tokenizer.backend.to_str())
    meta = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_ids": tokenizer.eos_token_ids,
        "add_bos": tokenizer.add_bos,
        "chat_template": tokenizer.chat_template,
    }
    (tmp / "tokenizer_meta.json").write_text(json.dumps(meta))
    try:
        tmp.rename(entry)
    except OSError:  # another process saved it first
        shutil.rmtree(tmp, ignore_errors=True)
    _remove_older_entries(entry, str(source.resolve()))


def _remove_older_entries(entry: Path, source: str) -> None:
    for other in entry.parent.iterdir():
        if other == entry or ".tmp" in other.name:  # ours, or one another process is still writing
            continue
        try:
            stale = (other / "source").read_text() == source
        except OSError:  # an entry from before entries named their source: not ours to judge
            continue
        if stale:
            shutil.rmtree(other, ignore_errors=True)


def load(entry: Path, source: str, shard: Shard | None = None) -> tuple[ModelConfig, dict, Tokenizer] | None:
    """The entry's model (with `shard`, that tensor-parallel rank's slices of its weights, the whole model's
    config), or None when there is none or it is damaged (then it is removed, to be rebuilt)."""
    if not entry.exists():
        return None
    try:
        return _read(entry, source, shard)
    except UserError:  # the entry is fine; the request does not fit the model
        raise
    except Exception as exc:  # the entry is only a copy of the GGUF: any fault in it means convert again
        discard(entry, f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}")
        return None


def cached_config(entry: Path) -> ModelConfig | None:
    """The entry's config alone, None where there is no readable one."""
    try:
        return ModelConfig.model_validate_json((entry / "config.json").read_text())
    except Exception:  # no entry, or a damaged one: the caller reads the GGUF
        return None


def discard(entry: Path, reason: str) -> None:
    print(f"warning: {entry}: damaged converted-model cache entry ({reason}); rebuilding it", file=sys.stderr)
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)
    else:
        entry.unlink(missing_ok=True)


def _read(entry: Path, source: str, shard: Shard | None = None) -> tuple[ModelConfig, dict, Tokenizer]:
    config = ModelConfig.model_validate_json((entry / "config.json").read_text())
    plan = shard.plan(config, source) if shard else None
    if plan is None:
        flat, groups = _mapped(entry / "weights.safetensors")
    else:
        with safe_open(str(entry / "weights.safetensors"), framework="pt") as f:
            groups = f.metadata() or {}
            flat = {}
            for name in f.keys():  # noqa: SIM118 (a safetensors handle)
                base, _, part = name.partition("#int4.")
                if plan.keeps(base):
                    flat[name] = _read_slice(f, name, plan.slice_of(base), int(groups.get(base, 1)), part)
        # the int4 weights of layers left unread (MTP modules)
        groups = {name: group for name, group in groups.items() if plan.keeps(name)}
    weights: dict = {}
    for name, tensor in flat.items():
        if "#int4." not in name:
            weights[name] = tensor
    for name, group in groups.items():
        parts = [flat[f"{name}#int4.{p}"] for p in _INT4_PARTS]
        weights[name] = Int4Weight(*parts, group_size=int(group))
    meta = json.loads((entry / "tokenizer_meta.json").read_text())
    if not isinstance(meta, dict) or set(meta) != _META_KEYS:
        raise ValueError(f"tokenizer_meta.json holds {sorted(meta) if isinstance(meta, dict) else type(meta)}")
    tokenizer = Tokenizer(HFTokenizer.from_str((entry / "tokenizer.json").read_text()), source=source, **meta)
    return config, weights, tokenizer


def _mapped(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file, every tensor a view of one private copy-on-write map of it:
    nothing is read before it is used, and what a caller is done with can leave memory again (`drop_pages`)."""
    with open(path, "rb") as f:
        header_bytes = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_bytes))
        whole = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    data = 8 + header_bytes
    metadata = header.pop("__metadata__", None) or {}
    tensors = {}
    for name, info in header.items():
        dtype, (start, end) = _DTYPES[info["dtype"]], info["data_offsets"]
        if end == start:
            tensors[name] = torch.empty(info["shape"], dtype=dtype)
            continue
        count = (end - start) // dtype.itemsize
        tensors[name] = torch.frombuffer(whole, dtype=dtype, count=count, offset=data + start).view(info["shape"])
    first = torch.frombuffer(whole, dtype=torch.uint8, count=1).data_ptr()
    _MAPS.append((weakref.ref(whole), first))
    return tensors, metadata


def drop_pages(*tensors: torch.Tensor) -> None:
    """Lets the memory pages of tensors that are views of an entry's map (`_mapped`) leave this process's resident
    memory: a read brings them back from the file. Tensors elsewhere are left alone. Only for tensors no one has
    written to (a written page of the private map would go back to the file's bytes)."""
    page = mmap.PAGESIZE
    for whole, first in _live_maps():
        for t in tensors:
            start = t.data_ptr() - first
            end = start + t.numel() * t.element_size()
            if start < 0 or end > len(whole):
                continue
            low, high = -(-start // page) * page, end // page * page  # whole pages only
            if high > low:
                whole.madvise(mmap.MADV_DONTNEED, low, high - low)


def drop_all_pages() -> None:
    """`drop_pages` for every page of the entries' maps: also those the kernel mapped in around what was read (it
    maps the neighbours of a page it faults in), which belong to no tensor that `drop_pages` is handed."""
    for whole, _ in _live_maps():
        whole.madvise(mmap.MADV_DONTNEED)


def _live_maps() -> list[tuple[mmap.mmap, int]]:
    """(map, its first address) of each entry map still in use; the others are forgotten."""
    live = [(ref, ref(), first) for ref, first in _MAPS]
    _MAPS[:] = [(ref, first) for ref, whole, first in live if whole is not None]
    return [(whole, first) for _, whole, first in live if whole is not None]


def _read_slice(f, name: str, cut: tuple[int, int, int] | None, group: int, part: str):
    """A rank's rows or columns of a stored tensor; an int4 weight's parts hold two columns a byte (packed) or
    one a group (scales, offsets), so its columns are cut on group boundaries."""
    if cut is None:
        return f.get_tensor(name)
    dim, start, stop = cut
    piece = f.get_slice(name)
    if dim == 0:
        return piece[start:stop]
    if part:
        if start % group or stop % group:
            raise UserError(
                f"{name.partition('#')[0]}: columns {start}..{stop} of a tensor-parallel rank would cut its int4 "
                f"groups of {group}; use a tensor-parallel size that keeps whole groups"
            )
        per = 2 if part == "packed" else group
        start, stop = start // per, stop // per
    return piece[:, start:stop]
