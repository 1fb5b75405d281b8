"""The compact runner: continuous batching over the per-slot KV cache.

Slots: running sequences occupy slots ``0..n-1`` in ``self.lanes`` order
(lane i == slot i). Releasing slot i moves the last lane's KV into it, so
decode always covers a dense prefix of slots and FlashAttention can address
lane i's keys at rows ``i * max_seq_len ...`` of the flattened cache.

Prefill is eager and packed (identical token lists computed once, their KV
copied to every slot of the group). Decode is one CUDA graph replay (CUDA) or
one eager call (CPU) over all lanes, followed by one device-to-host copy of
the sampled tokens and logprobs; `collect` is the only host sync per step.
"""

from __future__ import annotations

import logging

import torch

from streamrl.engine.runner import kernels, split_decode, weights
from streamrl.engine.runner.attention import flash_available
from streamrl.engine.runner.base import Pending
from streamrl.engine.runner.batch import DECODE_KERNELS, DecodeBatch, PrefillBatch
from streamrl.engine.runner.decoder import CompactModel
from streamrl.engine.runner.graphs import DecodeGraphs, bucket_for
from streamrl.engine.runner.kv_cache import KVCache
from streamrl.engine.runner.lanes import LaneBuffers
from streamrl.engine.runner.sampling import SamplingTensors, make_sampling_tensors, sample
from streamrl.engine.runner.sequence import Sequence

logger = logging.getLogger(__name__)


class CompactRunner(weights.InPlaceWeights):
    name = "compact"
    shares_prefill = True

    def __init__(
        self,
        config,
        state_dict: dict[str, torch.Tensor],
        *,
        device: torch.device,
        dtype: torch.dtype,
        max_batch_size: int,
        max_seq_len: int,
        max_prefill_tokens: int,
        cuda_graphs: bool = True,
        compile_elementwise: bool = False,
        use_flash: bool | None = None,
        decode_kernel: str | None = None,
    ):
        self.device, self.dtype = device, dtype
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.max_prefill_tokens = max_prefill_tokens
        self.model = CompactModel(config, max_positions=max_seq_len, device=device, dtype=dtype)
        self.targets = weights.hf_weight_targets(self.model)
        missing = weights.missing_names(
            self.targets, state_dict, tied=self.model.dims.tied_embeddings
        )
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
        self.load_weights(self.plan_weights(state_dict.items()))
        if compile_elementwise:
            self.model.ops = kernels.compiled_ops(device, self.model.dims.head_dim)
        dims = self.model.dims
        self.cache = KVCache(
            num_layers=dims.num_layers,
            num_slots=max_batch_size,
            max_seq_len=max_seq_len,
            num_kv_heads=dims.num_kv_heads,
            head_dim=dims.head_dim,
            device=device,
            dtype=dtype,
        )
        if use_flash is None:
            use_flash = flash_available(device, dtype, dims.head_dim)
        self.use_flash = use_flash
        if decode_kernel is None:  # the best that serves (batch.DECODE_KERNELS)
            decode_kernel = (
                "split"
                if split_decode.available(device, dtype, dims.head_dim)
                else "flash"
                if use_flash
                else "sdpa"
            )
        if decode_kernel not in DECODE_KERNELS:
            raise ValueError(f"decode_kernel {decode_kernel!r} is not one of {DECODE_KERNELS}")
        self.decode_kernel = decode_kernel
        self.buffers = LaneBuffers(max_batch_size, device)
        self.slot_base = torch.arange(max_batch_size, device=device) * max_seq_len
        self.lanes: list[Sequence] = []
        self.is_dirty = True  # lane set changed since the last upload
        self.use_filters = False
        self.next_max_len = 1  # host bound on lane lengths for the next eager step
        self.result_set = 0
        self.graphs = None
        self.pad_lanes = device.type == "cuda"
        """Eager steps shaped as the graphs are (bucket-sized, the whole cache's length): on
        CUDA, so that graphs on or off, a batch's tokens are the same (docs/engine.md)."""
        if cuda_graphs and device.type == "cuda":
            self.graphs = DecodeGraphs(self._decode_body, max_batch_size)
            self.graphs.capture()

    # -- slots --------------------------------------------------------------

    def num_free_slots(self) -> int:
        return self.max_batch_size - len(self.lanes)

    def release(self, seqs: list[Sequence]) -> None:
        """Free slots, then refill the holes below the new lane count from the lanes above it.

        Moves are few (only survivors above the new count move) and their sources
        and targets are disjoint, so one gather/scatter per cache tensor suffices."""
        leaving = {id(seq) for seq in seqs if seq.slot is not None}
        if not leaving:
            return
        keep_count = len(self.lanes) - len(leaving)
        holes = [i for i in range(keep_count) if id(self.lanes[i]) in leaving]
        movers = [seq for seq in self.lanes[keep_count:] if id(seq) not in leaving]
        if movers:
            # Rows 0..num_tokens-2 hold KV; one row more is harmless and in bounds.
            rows = max(seq.num_tokens for seq in movers)
            self.cache.move_slots([seq.slot for seq in movers], holes, rows)
        for seq in seqs:
            seq.slot = None
        for hole, mover in zip(holes, movers, strict=True):
            self.lanes[hole] = mover
            mover.slot = hole
        del self.lanes[keep_count:]
        self.is_dirty = True

    def reset(self) -> None:
        for seq in self.lanes:
            seq.slot = None
        self.lanes.clear()
        self.is_dirty = True

    # -- prefill ------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, groups: list[list[Sequence]]) -> tuple[list[int], list[float]]:
        seqs = [seq for group in groups for seq in group]
        if len(seqs) > self.num_free_slots():
            raise ValueError(f"{len(seqs)} sequences for {self.num_free_slots()} free slots")
        for seq in seqs:
            seq.slot = len(self.lanes)
            self.lanes.append(seq)
        self.is_dirty = True
        leaders = [group[0] for group in groups]
        seq_lens = [leader.num_tokens for leader in leaders]
        tokens, positions, rows = [], [], []
        for leader, length in zip(leaders, seq_lens, strict=True):
            tokens.extend(leader.tokens)
            positions.extend(range(length))
            base = leader.slot * self.max_seq_len
            rows.extend(range(base, base + length))
        cu_seqlens = [0]
        for length in seq_lens:
            cu_seqlens.append(cu_seqlens[-1] + length)
        device = self.device
        batch = PrefillBatch(
            cache=self.cache,
            rows=torch.tensor(rows, dtype=torch.int64, device=device),
            cu_seqlens=torch.tensor(cu_seqlens, dtype=torch.int32, device=device),
            seq_lens=seq_lens,
            use_flash=self.use_flash,
        )
        hidden = self.model(
            torch.tensor(tokens, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            batch,
        )
        last_rows = torch.tensor(cu_seqlens[1:], device=device) - 1
        logits = self.model.logits(hidden[last_rows])
        group_of_seq = []
        for index, group in enumerate(groups):
            group_of_seq.extend([index] * len(group))
            for follower in group[1:]:
                self.cache.copy_slot(group[0].slot, follower.slot, follower.num_tokens)
                follower.cached_tokens += follower.num_tokens
        if len(group_of_seq) != len(groups):
            logits = logits[torch.tensor(group_of_seq, device=device)]
        params = [seq.params for seq in seqs]
        st = make_sampling_tensors(
            params, [s.seed for s in seqs], [s.num_tokens for s in seqs], device
        )
        new_tokens, logprobs = sample(
            logits,
            st,
            use_filters=SamplingTensors.needs_filters(params),
            softmax=self.model.ops.softmax,
            uniform=self.model.ops.uniform,
        )
        return new_tokens.tolist(), logprobs.tolist()

    # -- decode -------------------------------------------------------------

    def _decode_body(self, lanes: int, use_filters: bool, max_len: int | None = None) -> None:
        """One decode step over lanes ``0..lanes-1``, reading and advancing the lane buffers."""
        buffers = self.buffers
        tokens = buffers.tokens[:lanes]
        positions = buffers.positions[:lanes]
        active = buffers.active[:lanes]
        rows = torch.where(active > 0, self.slot_base[:lanes] + positions, self.cache.scratch_row)
        batch = DecodeBatch(
            cache=self.cache,
            rows=rows,
            lengths=(positions + 1).to(torch.int32),
            max_len=max_len or self.max_seq_len,
            kernel=self.decode_kernel,
        )
        # In the model dtype: every op of the sampler reads it as float32 values.
        logits = self.model.logits(self.model(tokens, positions, batch), float32=False)
        ops = self.model.ops
        new_tokens, logprobs = sample(
            logits,
            buffers.sampling(lanes),
            use_filters=use_filters,
            softmax=ops.softmax,
            uniform=ops.uniform,
            unfiltered=ops.sample_rows,
        )
        buffers.out_tokens[:lanes].copy_(new_tokens)
        buffers.out_logprobs[:lanes].copy_(logprobs)
        tokens.copy_(new_tokens)
        positions.add_(active)

    def _run_decode(self, lanes: int) -> None:
        if self.graphs is not None and self.graphs.replay(lanes, self.use_filters):
            return
        if self.graphs is not None or self.pad_lanes:
            # Eager, shaped exactly as the graphs are (no graph for this key, or CUDA without
            # graphs: the same kernels on the same shapes, so the same tokens).
            self._decode_body(bucket_for(self.max_batch_size, lanes), self.use_filters)
        else:
            self._decode_body(lanes, self.use_filters, min(self.next_max_len, self.max_seq_len))

    @torch.no_grad()
    def launch_decode(self) -> Pending:
        lanes = len(self.lanes)
        if self.is_dirty:
            self.buffers.upload(self.lanes)
            self.use_filters = SamplingTensors.needs_filters([s.params for s in self.lanes])
            self.next_max_len = max(seq.num_tokens for seq in self.lanes)
            self.is_dirty = False
        self._run_decode(lanes)
        self.next_max_len += 1
        result_set, self.result_set = self.result_set, 1 - self.result_set
        host_tokens = self.buffers.host_tokens[result_set]
        host_logprobs = self.buffers.host_logprobs[result_set]
        host_tokens[:lanes].copy_(self.buffers.out_tokens[:lanes], non_blocking=True)
        host_logprobs[:lanes].copy_(self.buffers.out_logprobs[:lanes], non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return Pending(seqs=list(self.lanes), handle=(event, result_set, lanes))

    def collect(self, pending: Pending) -> tuple[list[int], list[float]]:
        event, result_set, lanes = pending.handle
        if event is not None:
            event.synchronize()
        tokens = self.buffers.host_tokens[result_set][:lanes].tolist()
        logprobs = self.buffers.host_logprobs[result_set][:lanes].tolist()
        return tokens, logprobs

    # -- weights ------------------------------------------------------------
