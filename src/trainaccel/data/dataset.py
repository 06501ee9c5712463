"""`RecordDataset`: a map-style dataset over packed shards or TFRecord shards from other tools, local or remote."""

from __future__ import annotations

import bisect
import glob
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainaccel.data.decode import decode_image
from trainaccel.data.example import ImageRecord
from trainaccel.data.records import RecordFile, parse_index, scan_index
from trainaccel.data.storage import BlockCache, RemoteSource, Store, is_url, join, local_path, parse_bytes

OUTPUTS = ("pil", "tensor", "bytes")


class RecordDataset(torch.utils.data.Dataset):
    """`(image, label)` pairs from shards, with random access through each shard's index.

    `path` is a pack's folder or manifest.json, a shard, or a glob of shards (their `.index`
    files are used, or the index is built by scanning); a local path or a URL that fsspec opens
    (`s3://bucket/pack`, `gs://...`, `https://host/pack`). `output`: "pil" (RGB PIL image),
    "tensor" (uint8 CHW, channels-last in memory) or "bytes" (as stored). JPEGs decode with
    libjpeg-turbo (simplejpeg), other formats with Pillow. `decode_size=(w, h)` lets JPEG decoding
    scale down by 2, 4 or 8 in the DCT domain to no less than that size. CRCs are checked on every
    read unless `verify=False`. A transform that decodes (`trainaccel.data.RandomResizedCrop`,
    `CenterCrop`) receives the stored bytes instead, and `output` then only tells "bytes" apart.

    Remote shards are read in blocks of whole records of about `block_size` bytes, through a
    folder the loader workers share: `cache_dir` (kept, up to `cache_limit`, evicting whole
    shards) or a temporary one. Once a shard is read, its other blocks are fetched ahead on
    `prefetch` threads per process. `storage_options` go to fsspec
    (credentials, endpoint). Each remote call is bounded by `timeout` seconds and retried
    `retries` times with backoff.
    """

    def __init__(
        self,
        path: str | Path,
        transform: Callable[[Any], Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
        output: str = "pil",
        decode_size: int | tuple[int, int] | None = None,
        verify: bool = True,
        *,
        storage_options: dict[str, Any] | None = None,
        cache_dir: str | Path | None = None,
        cache_limit: int | str = "1GB",
        block_size: int | str = "8MB",
        prefetch: int = 2,
        retries: int = 5,
        timeout: float = 60.0,
    ):
        if output not in OUTPUTS:
            raise ValueError(f"invalid output={output!r}; accepted: {', '.join(OUTPUTS)}")
        if isinstance(decode_size, int) and not isinstance(decode_size, bool):
            decode_size = (decode_size, decode_size)
        if decode_size is not None and (len(decode_size) != 2 or min(decode_size) < 1):
            raise ValueError(f"invalid decode_size={decode_size!r}; accepted: a size N or (width, height), at least 1")
        if decode_size is not None and hasattr(transform, "from_encoded"):
            raise ValueError(
                f"decode_size={decode_size!r} with {type(transform).__name__}, which picks the decoding scale "
                "from each crop; leave decode_size out"
            )
        self.transform, self.target_transform = transform, target_transform
        self.output, self.decode_size = output, decode_size
        self.labels: dict[str, int] = {}
        self.store: Store | None = None
        self.cache: BlockCache | None = None
        if is_url(path):
            block = parse_bytes(block_size, "block_size")
            self.store = Store(str(path), storage_options, retries, timeout)
            self.cache = BlockCache(cache_dir, cache_limit, prefetch)
            self.shards = self._remote_shards(str(path), block, verify)
        else:
            self.shards = [RecordFile(s, verify=verify) for s in self._find_shards(local_path(path))]
        self._ends = np.cumsum([len(s) for s in self.shards]).tolist()

    def _find_shards(self, path: Path) -> list[Path]:
        manifest = path / "manifest.json" if path.is_dir() else path if path.name == "manifest.json" else None
        if manifest is not None:
            if not manifest.is_file():
                raise FileNotFoundError(
                    f"no manifest.json in {path}; pass a pack's folder, a shard or a glob of shards"
                )
            content = json.loads(manifest.read_text())
            self.labels = content.get("labels", {})
            return [manifest.parent / s["name"] for s in content["shards"]]
        found = sorted(Path(p) for p in glob.glob(str(path))) if glob.has_magic(str(path)) else [path]
        shards = [p for p in found if p.is_file() and not p.name.endswith(".index")]
        if not shards:
            raise FileNotFoundError(f"no shards match {path}")
        return shards

    def _remote_shards(self, url: str, block_size: int, verify: bool) -> list[RecordFile]:
        store = self.store
        assert store is not None and self.cache is not None
        tags: dict[str, str] = {}
        if url.endswith("manifest.json") or not glob.has_magic(url):
            manifest = url if url.endswith("manifest.json") else join(url, "manifest.json")
            try:
                content = json.loads(store.read(manifest))
            except FileNotFoundError:
                if url.endswith("manifest.json"):
                    raise FileNotFoundError(f"no manifest at {url}") from None
                if not store.exists(url):
                    raise FileNotFoundError(
                        f"no manifest.json under {url} and no shard at {url}; pass a pack's folder, "
                        "a shard or a glob of shards"
                    ) from None
                urls = [url]
            else:
                self.labels = content.get("labels", {})
                base = manifest.rsplit("/", 1)[0]
                urls = [join(base, s["name"]) for s in content["shards"]]
                tags = {join(base, s["name"]): s.get("sha256", "") for s in content["shards"]}
        else:
            urls = [u for u in store.glob(url) if not u.endswith(".index")]
            if not urls:
                raise FileNotFoundError(f"no shards match {url}")
        indexes = self._remote_indexes(urls)
        shards = []
        for shard, index in zip(urls, indexes):
            # The index is part of the cache key: a shard rewritten with other records never reads old blocks.
            tag = tags.get(shard, "") + hashlib.sha256(index.tobytes()).hexdigest()[:16]
            source = RemoteSource(shard, store, self.cache, index, block_size, tag)
            shards.append(RecordFile(shard, index, verify=verify, source=source))
        return shards

    def _remote_indexes(self, urls: list[str]) -> list[np.ndarray]:
        """Each shard's index: its `.index` object, fetched many at a time, or found by reading the whole shard."""
        store = self.store
        assert store is not None
        indexes = []
        for start in range(0, len(urls), 64):
            batch = [f"{u}.index" for u in urls[start : start + 64]]
            texts = store.call(
                "cat", batch, on_error="return", what=f"reading {len(batch)} shard indexes from {batch[0]}"
            )
            for name in batch:
                text = texts.get(name, texts.get(name.split("://", 1)[-1]))
                if isinstance(text, bytes):
                    indexes.append(parse_index(text.decode(), name))
                elif text is None or isinstance(text, FileNotFoundError):
                    shard = name[: -len(".index")]
                    indexes.append(scan_index(store.read(shard), shard))
                else:
                    raise text
        return indexes

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def locate(self, index: int) -> tuple[int, int]:
        """(shard number, record number in the shard) of a dataset index."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for a dataset of {len(self)} records")
        index %= len(self)
        shard = bisect.bisect_right(self._ends, index)
        return shard, index - (self._ends[shard - 1] if shard else 0)

    def record(self, index: int) -> ImageRecord:
        """The stored record: encoded bytes, label, size and file name."""
        shard, number = self.locate(index)
        return ImageRecord.from_example(self.shards[shard][number])

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        record = self.record(index)
        image: Any = record.encoded
        # A transform that decodes (trainaccel.data.RandomResizedCrop, CenterCrop) takes the stored bytes.
        fused = getattr(self.transform, "from_encoded", None) if self.output != "bytes" else None
        if self.output != "bytes":
            try:
                if fused is not None:
                    image = fused(record.encoded)
                else:
                    image = decode_image(record.encoded, self.output, self.decode_size)
            except Exception as error:  # name the record: the decoders' own messages say only what broke
                shard, number = self.locate(index)
                raise ValueError(
                    f"cannot decode the image of record {number} ({record.filename or 'no file name'}) "
                    f"in {self.shards[shard].shard}: {error}"
                ) from error
        label: Any = record.label
        if self.transform is not None and fused is None:
            image = self.transform(image)
        if self.target_transform is not None:
            label = self.target_transform(label)
        return image, label

    def plan_reads(self, indices: list[int]) -> None:
        """The order records will be read in (a sampler's, for this rank): each remote shard then
        reads the next one ahead once it is read itself. Local shards need no plan."""
        if self.store is None or not indices:
            return
        shards = np.searchsorted(np.asarray(self._ends), np.asarray(indices), side="right")
        firsts = shards[np.concatenate(([True], shards[1:] != shards[:-1]))]
        seen: dict[int, None] = dict.fromkeys(firsts.tolist())  # first appearances, in order
        sequence = list(seen)
        for shard in self.shards:
            shard.source.next = None
        for shard, following in zip(sequence, sequence[1:]):
            self.shards[shard].source.next = self.shards[following].source

    def shard_ranges(self) -> list[tuple[int, int]]:
        """Each shard's [start, end) of dataset indices, for samplers that keep reads local."""
        starts = [0, *self._ends[:-1]]
        return list(zip(starts, self._ends))
