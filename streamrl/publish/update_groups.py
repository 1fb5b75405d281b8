"""The weight-update groups `GroupTransport` keeps over the live engines, one per pipeline stage.

A group is built the way SGLang builds its own (`streamrl.weights.group`): its rank 0
is this process (stage 0) or a pipeline stage's publisher rank (`Host` over
`streamrl.weights.stages`), and every engine joins with `/init_weights_update_group`
at its ranks (`streamrl.weights.layout`), all concurrently, since each join blocks
until every rank is in. The groups are rebuilt when the set of engines changes (an
engine restarted) or after a failed update; `close` leaves them when the run stops.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio

from streamrl.fleet.client import EngineClient, EngineError, engine_gpu_counts
from streamrl.process import free_port
from streamrl.weights.group import destroy_weight_update_group, join_in_daemon_thread
from streamrl.weights.layout import WeightGroupLayout, weight_group_layout
from streamrl.weights.stages import Drop, Host, RemoteStages

log = logging.getLogger(__name__)

DESTROY_TIMEOUT_S = 10.0
"""A member that does not confirm leaving the old group within this is left behind."""


@dataclass
class UpdateGroup:
    name: str
    members: tuple[str, ...]
    """The URLs of the engines in it."""
    handle: object
    """This process's side of the group (stage 0); None for a group a stage rank hosts."""
    stage: int = 0


@dataclass
class UpdateGroups:
    """The groups of one transport (see the module docstring)."""

    transport: str
    """The groups' torch.distributed backend: `nccl` or `gloo`."""
    master_address: str
    members: Callable[[], list[EngineClient]]
    """The engines that hold (or should hold) the newest weights."""
    gpu_counts: Callable[[list[EngineClient]], Awaitable[list[int]]] = engine_gpu_counts
    stages: RemoteStages | None = None
    groups: list[UpdateGroup] = field(default_factory=list)
    """One group per pipeline stage, in stage order."""
    is_stale: bool = False

    async def ensure(self, engines: list[EngineClient], num_stages: int) -> list[UpdateGroup]:
        """The groups over exactly `engines`, one per stage: the current ones, or new ones."""
        members = tuple(engine.url for engine in engines)
        is_current = len(self.groups) == num_stages and not self.is_stale
        if is_current and all(group.members == members for group in self.groups):
            return self.groups
        self.is_stale = False
        await self.drop()
        layout = weight_group_layout(await self.gpu_counts(engines))
        # One group at a time: an engine joins one group at a time, so engines joining
        # different groups at once would each wait for the other.
        for stage in range(num_stages):
            self.groups.append(await self._create(engines, layout, stage))
        return self.groups

    async def _create(
        self, engines: list[EngineClient], layout: WeightGroupLayout, stage: int
    ) -> UpdateGroup:
        """A new group over `engines` whose rank 0 is this process (stage 0) or stage's rank."""
        name = f"streamrl-{uuid.uuid4().hex[:8]}" + (f"-stage{stage}" if stage else "")
        if stage:  # hosted by the stage's rank, maybe on another node
            address, port = await self.stages.rendezvous(stage)
        else:
            address, port = self.master_address, free_port(self.master_address)
        handle = None

        async def host() -> None:
            nonlocal handle
            if stage:
                request = Host(name, address, port, layout.world_size, self.transport)
                await self.stages.request(stage, request)
                return
            # Abandoned if an engine's join fails (it died before joining): the rendezvous
            # would otherwise hold this update until it times out.
            handle = await join_in_daemon_thread(
                master_address=address,
                master_port=port,
                rank=0,
                world_size=layout.world_size,
                group_name=name,
                backend=self.transport,
            )

        # One rendezvous, not `each_engine`: a member that fails dooms the group, so its error
        # cancels every other join at once rather than waiting for joins that cannot finish.
        async with anyio.create_task_group() as tg:
            tg.start_soon(host)
            for engine, rank_offset in zip(engines, layout.rank_offsets, strict=True):
                tg.start_soon(
                    lambda e=engine, r=rank_offset: e.init_weights_update_group(
                        master_address=address,
                        master_port=port,
                        rank_offset=r,
                        world_size=layout.world_size,
                        group_name=name,
                        backend=self.transport,
                    )
                )
        log.info(
            "weight-update group %s: learner stage %d + %d engines (world size %d)",
            name,
            stage,
            len(engines),
            layout.world_size,
        )
        return UpdateGroup(name, tuple(engine.url for engine in engines), handle, stage)

    async def drop(self) -> None:
        """Every stage's group, on the engines and on its rank 0."""
        groups, self.groups = self.groups, []
        for group in groups:
            for url in group.members:
                engine = next((e for e in self.members() if e.url == url), None)
                if engine is not None:
                    try:
                        with anyio.fail_after(DESTROY_TIMEOUT_S):
                            await engine.destroy_weights_update_group(group.name)
                    except (EngineError, TimeoutError) as exc:
                        log.info("could not destroy group on %s: %s", url, exc or "timeout")
            if group.handle is not None:
                await anyio.to_thread.run_sync(destroy_weight_update_group, group.handle)
            elif group.stage:
                try:  # the stage destroys it after the broadcast it may still be stuck in
                    with anyio.fail_after(DESTROY_TIMEOUT_S):
                        await self.stages.request(group.stage, Drop(group.name))
                except (RuntimeError, TimeoutError) as exc:
                    log.info(
                        "stage %d kept group %s: %s", group.stage, group.name, exc or "timeout"
                    )

    async def close(self) -> None:
        """Leave this process's groups when the run stops (shielded and bounded: it runs
        while the publisher is cancelled). Stage ranks destroy theirs when they stop."""
        groups, self.groups = self.groups, []
        with anyio.CancelScope(shield=True), anyio.move_on_after(DESTROY_TIMEOUT_S):
            for group in groups:
                if group.handle is not None:
                    await anyio.to_thread.run_sync(
                        destroy_weight_update_group, group.handle, abandon_on_cancel=True
                    )
