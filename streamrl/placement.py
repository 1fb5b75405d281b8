"""Which CUDA devices each engine uses: pure arithmetic on the config's GPU lists.

A leaf: it imports nothing of streamrl, so the config (placement checks), the
engine fleet (CUDA_VISIBLE_DEVICES per engine) and the SGLang launcher all
read one rule.
"""

from __future__ import annotations

from collections.abc import Sequence


def engine_gpu_ids(
    num_engines: int, gpus_per_engine: int, engine_gpus: Sequence[int] = ()
) -> list[list[int]]:
    """The CUDA devices of each engine: engine i gets entries [i * t, (i + 1) * t) of
    `engine_gpus` (t = `gpus_per_engine`), or of 0..num_engines * t - 1 when it is empty.

    Engines may share a device (`engine_gpus = [0, 0]`: two engines on GPU 0, each with its
    share of memory); one engine may not list a device twice. Raises ValueError (naming the
    config keys) when `engine_gpus` is too short or an engine repeats a device; devices
    beyond the ones needed are left unused."""
    needed = num_engines * gpus_per_engine
    pool = list(engine_gpus) or list(range(needed))
    if len(pool) < needed:
        raise ValueError(
            f"engine.num_engines = {num_engines} engines x engine.tp_size = {gpus_per_engine} "
            f"need {needed} GPUs, but cluster.engine_gpus = {pool} has {len(pool)}"
        )
    placement = [pool[i * gpus_per_engine : (i + 1) * gpus_per_engine] for i in range(num_engines)]
    for gpus in placement:
        repeated = sorted({gpu for gpu in gpus if gpus.count(gpu) > 1})
        if repeated:
            raise ValueError(
                f"cluster.engine_gpus lists device(s) {repeated} more than once for one engine "
                f"(engine.tp_size = {gpus_per_engine})"
            )
    return placement


def shared_engine_gpus(placement: Sequence[Sequence[int]]) -> list[bool]:
    """For each engine of `placement` (`engine_gpu_ids`), whether an engine before it uses
    one of its devices (it then starts after that one serves: SGLang sizes its KV pool from
    the memory free when it starts)."""
    seen: set[int] = set()
    shared = []
    for gpus in placement:
        shared.append(bool(seen & set(gpus)))
        seen.update(gpus)
    return shared
