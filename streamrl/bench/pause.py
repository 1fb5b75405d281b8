"""`streamrl bench pause`: what each pause mode costs a running engine, per weight update.

Against one engine (SGLang or the embedded one) at `--url` serving `--model`:
for each mode of `--modes`, keep `--requests` long requests decoding (through
`GenerateContext`, as the rollout worker does: an aborted request is resumed
from its partial output as a new request), and `--updates` times: pause with the
mode, reload the served checkpoint from disk as the next version (flushing the
prefix cache only in `abort` mode, as the publisher does: a flush while requests
are held fails, and SGLang asserts on it), continue. Reported per mode:

- pause_s: `/pause_generation` call until it returns (abort waits for the
  aborted requests to leave the server);
- update_s and continue_s (the reload is the same in every mode);
- resumed prompt tokens: what the resumed requests sent again as their prompt
  (prompt + partial output), the extra prefill `abort` costs; `retract` and
  `in_place` resume inside the engine;
- inexact samples: requests whose tokens' versions are only bounded
  (`VersionRule`): SGLang sends one version per response, exact in `abort` mode;
- tokens/s of the whole phase, updates included.

Besides SGLang's modes, `retract_abort` (`weights.pause_mode`; `EngineClient.pause`)
pauses with `retract` (requests go back to the
queue at once) and then aborts every request (`/abort_request` with `abort_all`), so that
each returns its partial output as in `abort` without `abort`'s wait: SGLang 0.5.17's
`abort` pause re-sends its abort and sleeps a second at a time while any request still
holds the update lock (`TokenizerManager.pause_generation`), and a request aborted from
the waiting queue answers with the output ids and log-probabilities its tokenizer manager
had received (`TokenizerManager._handle_abort_req`): a request that does not stream
reports every 50 tokens (`SGLANG_FORCE_STREAM_INTERVAL`), so up to 49 generated tokens are
dropped and generated again. On SGLang 0.5.17 (one H200, 64 requests) it paused 4.8 ms
against `abort`'s 1,014 ms, every sample's versions exact, and the cache flush succeeded
(bench/results/gpu/sglang_pause_h200x1.json).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Any

import anyio

from streamrl.bench.results import write_result


def pause_command(args: argparse.Namespace) -> int:
    modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    result = anyio.run(_measure, args, modes)
    for mode, row in result["modes"].items():
        print(
            f"{mode}: pause {row['pause_s_median'] * 1e3:.1f} ms median, "
            f"{row['resume_prompt_tokens']} prompt tokens resent, "
            f"{row['inexact_samples']}/{row['num_samples']} inexact, "
            f"{row['tokens_per_s']:.0f} tok/s"
        )
    if args.json:
        config = {key: getattr(args, key) for key in ("url", "model", "modes", "requests")}
        config.update(updates=args.updates, max_new_tokens=args.max_new_tokens)
        write_result(
            args.json, bench="pause", config=config, result=result, plot=plot_pause, num_panels=2
        )
    return 0


async def _measure(args: argparse.Namespace, modes: list[str]) -> dict[str, Any]:
    from streamrl.fleet.client import EngineClient

    async with EngineClient(args.url, timeout_s=600) as engine:
        served = await engine.model_info()
        rows = {}
        for mode in modes:
            rows[mode] = await _one_mode(args, engine, mode, served["model_path"])
        await engine.update_weights_from_disk(
            served["model_path"], weight_version=served["weight_version"]
        )
    return {"server_version": served.get("version"), "modes": rows}


async def _one_mode(args, engine, mode: str, model_path: str) -> dict[str, Any]:
    from streamrl.agents.api import GenerateContext, VersionRule
    from streamrl.config.sections import EMPTYING_PAUSES
    from streamrl.fleet.engine_set import EngineSet
    from streamrl.fleet.results import parse_version

    version = parse_version((await engine.model_info())["weight_version"])
    floor = {"version": version}
    aborts = mode in EMPTYING_PAUSES  # requests leave: one version each, flushable
    prompts = [
        [1 + (7 * i + j) % 500 for j in range(args.prompt_tokens)] for i in range(args.requests)
    ]
    params = {"max_new_tokens": args.max_new_tokens, "ignore_eos": True, "temperature": 1.0}
    completions: list = []
    timings: dict[str, list[float]] = {"pause_s": [], "update_s": [], "continue_s": []}
    started = time.perf_counter()
    async with EngineSet([args.url]) as engines, anyio.create_task_group() as tg:
        ctx = GenerateContext(
            engines=engines,
            tokenizer=None,
            sampling_params=params,
            version_rule=VersionRule(single_version=aborts, floor=lambda: floor["version"]),
        )

        async def one(prompt: list[int]) -> None:
            completions.append(await ctx.generate(prompt))

        for prompt in prompts:
            tg.start_soon(one, prompt)
        for _ in range(args.updates):
            await anyio.sleep(args.interval_s)
            version += 1
            calls = {
                "pause_s": functools.partial(engine.pause, mode),
                "update_s": functools.partial(
                    engine.update_weights_from_disk,
                    model_path,
                    weight_version=version,
                    flush_cache=aborts,
                ),
                "continue_s": engine.continue_generation,
            }
            for name, call in calls.items():
                begun = time.perf_counter()
                await call()
                timings[name].append(time.perf_counter() - begun)
            floor["version"] = version
    wall_s = time.perf_counter() - started
    tokens = sum(len(c.output_ids) for c in completions)
    return {
        **{f"{k}_median": statistics.median(v) if v else 0.0 for k, v in timings.items()},
        **{f"{k}_all": v for k, v in timings.items()},
        "num_samples": len(completions),
        "resumes": sum(c.num_resumes for c in completions),
        "resume_prompt_tokens": sum(c.resume_prompt_tokens for c in completions),
        "inexact_samples": sum(not c.versions_exact for c in completions),
        "generated_tokens": tokens,
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s,
    }


def plot_pause(result: dict[str, Any], axes) -> None:
    modes = list(result["modes"])
    left, right = axes
    pauses = [result["modes"][m]["pause_s_median"] * 1e3 for m in modes]
    left.bar(modes, pauses, color="tab:blue")
    left.set_ylabel("pause_generation, median (ms)")
    left.set_title("Pause per update")
    resent = [result["modes"][m]["resume_prompt_tokens"] for m in modes]
    right.bar(modes, resent, color="tab:orange")
    right.set_ylabel("prompt tokens sent again (all updates)")
    right.set_title("Extra prefill of resumed requests")
