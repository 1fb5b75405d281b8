"""Giving a runner's device memory back and taking it again, by SGLang's tags.

    weights     every parameter's storage (freed; resumed as zeros: the values are lost, as
                SGLang's are without `--enable-weights-cpu-backup`, until the next update)
    kv_cache    the compact runner's per-slot KV cache (resumed zeroed, its starting state);
                the transformers runner holds a wave's cache only while a wave runs
    cuda_graph  the compact runner's decode graphs and their memory pool

A release frees storages in place (`untyped_storage().resize_(0)`) rather than dropping
tensors: every parameter, view and target the runner keeps stays the same Python object,
and a resume re-allocates the same sizes behind them. The addresses change, so captured
CUDA graphs (which hold addresses) are dropped with the first release of weights or KV
cache and captured again once all three regions are back. On CUDA the caching allocator's
free blocks go back to the driver (`empty_cache`), so another process can use them; on
the CPU the same code path runs and the freed storages report 0 bytes.

Only on the engine thread, with no sequence running or waiting (SGLang asserts the same).
"""

from __future__ import annotations

import torch

TAGS = ("weights", "kv_cache", "cuda_graph")


def parse_tags(tags: object) -> tuple[str, ...]:
    """A request's `tags`: None or empty means all three; ValueError names an unknown tag."""
    if tags is None or tags == []:
        return TAGS
    if not isinstance(tags, list) or not all(isinstance(tag, str) for tag in tags):
        raise ValueError(f"tags must be a list of strings, not {tags!r}")
    unknown = [tag for tag in tags if tag not in TAGS]
    if unknown:
        raise ValueError(f"unknown memory tags {unknown}: known are {', '.join(TAGS)}")
    return tuple(dict.fromkeys(tags))


class Occupation:
    """The release state of one runner's memory regions (see the module docstring)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.released: set[str] = set()
        self.needs_capture = False
        """Graphs were dropped (their addresses went stale); captured once all is back."""
        self._sizes: dict[str, list[tuple[torch.UntypedStorage, int]]] = {}
        """Per released region: each storage and the bytes it had."""

    def _storages(self, tag: str) -> list[torch.UntypedStorage]:
        """The distinct storages of a region (a tied head shares the embedding's)."""
        runner = self.runner
        if tag == "weights":
            tensors = list(runner.model.parameters())
        elif tag == "kv_cache":
            cache = getattr(runner, "cache", None)
            tensors = [cache.keys, cache.values] if hasattr(cache, "keys") else []
        else:
            tensors = []
        unique: dict[int, torch.UntypedStorage] = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            unique.setdefault(storage._cdata, storage)  # one entry per storage, not per view
        return list(unique.values())

    def resident_bytes(self) -> dict[str, int]:
        """Bytes each region holds now (0 once released)."""
        return {
            tag: sum(storage.nbytes() for storage in self._storages(tag))
            for tag in ("weights", "kv_cache")
        }

    def release(self, tags: tuple[str, ...]) -> int:
        """Free the regions of `tags` not yet released; returns the bytes freed."""
        freed = 0
        for tag in tags:
            if tag in self.released:
                continue
            if tag in ("weights", "kv_cache"):
                storages = self._storages(tag)
                self._sizes[tag] = [(storage, storage.nbytes()) for storage in storages]
                self._drop_graphs()
                for storage in storages:
                    freed += storage.nbytes()
                    storage.resize_(0)
            else:
                self._drop_graphs()
            self.released.add(tag)
        self._return_to_device()
        return freed

    def resume(self, tags: tuple[str, ...]) -> None:
        """Re-allocate the released regions of `tags` (zeroed); capture the graphs again
        once nothing is released. ValueError for a tag that is not released."""
        not_released = [tag for tag in tags if tag not in self.released]
        if not_released:
            raise ValueError(f"memory {not_released} is not released")
        for tag in tags:
            for storage, num_bytes in self._sizes.pop(tag, []):
                storage.resize_(num_bytes)
                torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).zero_()
            self.released.discard(tag)
        if not self.released and self.needs_capture:
            self.runner.graphs.capture()
            self.needs_capture = False

    def _drop_graphs(self) -> None:
        graphs = getattr(self.runner, "graphs", None)
        if graphs is not None and graphs.graphs:
            graphs.graphs.clear()
            self.needs_capture = True

    def _return_to_device(self) -> None:
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
            torch.cuda.empty_cache()
