"""The gateway's generate function: run an unchanged agent against a session's base URL.

    rollout.generate_fn = "streamrl.agents.gateway:generate"

    per sample:  session = gateway.open_session(ctx)        # its own base URL / API key
                 result  = await agent(base_url, prompt)     # or a command line, see below
                 trajectory = session.result()               # the trained branch, token-exact
                 reward: episode_reward(Episode) | result["reward"] | rollout.reward_fn

The agent is either

- `agent = "module:function"`: `async def function(base_url, prompt, **agent_kwargs)`
  (or a plain function, run in a worker thread: agents written with the synchronous
  clients), called in the rollout process with the base URL of `api` ("openai": …/v1,
  for `openai.AsyncOpenAI(base_url=...)`; "anthropic": for `anthropic.AsyncAnthropic`)
  and the `streamrl.types.Prompt`;
- `command = ["python", "agent.py", ...]`: a separate process per episode, with
  OPENAI_BASE_URL / ANTHROPIC_BASE_URL set to the session's URLs and OPENAI_API_KEY /
  ANTHROPIC_API_KEY to the session id (both clients read these), the prompt as one JSON
  line on stdin and in STREAMRL_PROMPT (`{"text", "label", "metadata", "seq", "index",
  "epoch"}`), and STREAMRL_RESULT_FILE where it may write its result as JSON. A non-zero
  exit fails the sample (the tail of its output is in the error).

Either way `timeout_s` bounds the episode (the process group is killed; a coroutine is
cancelled; a thread is abandoned, and its session closed so its next call gets 404).

Reward: `episode_reward = "module:function"` is called with the whole `Episode` (prompt,
the agent's result, the trained conversation as OpenAI messages, the trajectory with
tokens, masks, logprobs, versions and turn offsets) and returns a float or a dict with
`reward` (as any reward function; a failure gives reward 0 and marks the sample
`reward_failed`). Without it, an agent result `{"reward": x}` is the reward, and
otherwise `rollout.reward_fn` scores `trajectory.text`: the agent's result when it is a
string, else the content of the trained branch's last reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import anyio
import anyio.to_thread
import msgspec

from streamrl.agents.api import GenerateContext, Trajectory
from streamrl.agents.env import log_episode, parse_options
from streamrl.agents.gateway.app import current_gateway, serving
from streamrl.agents.gateway.sessions import Session, SessionOptions
from streamrl.process import die_with_parent
from streamrl.rewards import score
from streamrl.types import Prompt
from streamrl.utils import import_object

log = logging.getLogger(__name__)

_AGENT_THREADS = anyio.CapacityLimiter(64)
"""Worker threads for synchronous agents (a timed-out one is abandoned here)."""


class AgentOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`rollout.generate_kwargs` of `streamrl.agents.gateway:generate`."""

    agent: str = ""
    """`module:function` of an agent run in the rollout process (see the module docstring)."""
    agent_kwargs: dict[str, Any] = {}
    """Keyword arguments of the agent function."""
    command: list[str] = []
    """Or: the command line of an agent run as its own process per episode; `{python}`
    in it is this process's interpreter (`sys.executable`)."""
    cwd: str = ""
    """Working directory of the agent process; empty: the rollout process's."""
    env: dict[str, str] = {}
    """Extra environment variables of the agent process."""
    api: Literal["openai", "anthropic"] = "openai"
    """Which base URL an in-process agent gets (a process gets both)."""
    timeout_s: float = 600.0
    """Wall time per episode at most."""
    max_calls: int = 0
    """Model calls per episode at most (more are answered 429); 0: no limit."""
    max_total_tokens: int = 0
    """Context plus new tokens of a call at most (keep <= engine.max_seq_len); 0: no limit."""
    max_new_tokens: int = 0
    """Cap on a call's max_tokens; 0: rollout.sampling.max_new_tokens."""
    on_divergence: Literal["branch", "error"] = "branch"
    """A call whose history is not the previous reply's continuation: start a new branch
    (counted; the last branch is trained) or answer 409."""
    sampling: Literal["config", "request"] = "config"
    """Whose temperature / top_p / top_k apply: rollout.sampling's, or the request's."""
    tool_format: Literal["auto", "hermes", "llama3", "none"] = "auto"
    """Tool-call format of the model's output; `auto` reads it from the chat template."""
    episode_reward: str = ""
    """`module:function` scoring the whole `Episode`; empty: see the module docstring."""
    reward_timeout_s: float = 60.0
    """Deadline of `episode_reward`."""
    model_name: str = "policy"
    """Unused by the gateway (any `model` is served); listed by /v1/models."""
    episode_log: str = ""
    """Append one JSON line per episode (turns, calls, branches, reward) to this file."""

    def __post_init__(self) -> None:
        if bool(self.agent) == bool(self.command):
            raise ValueError("give exactly one of agent (module:function) and command")
        if (
            self.timeout_s <= 0
            or min(self.max_calls, self.max_total_tokens, self.max_new_tokens) < 0
        ):
            raise ValueError(
                "timeout_s must be > 0; max_calls, max_total_tokens, max_new_tokens >= 0"
            )

    @property
    def session_options(self) -> SessionOptions:
        return SessionOptions(
            max_calls=self.max_calls,
            max_total_tokens=self.max_total_tokens,
            max_new_tokens=self.max_new_tokens,
            on_divergence=self.on_divergence,
            sampling=self.sampling,
        )


@dataclass
class Episode:
    """What an `episode_reward` function gets: the whole episode."""

    prompt: Prompt
    result: Any
    """The agent's return value (a process: its result file's JSON, None without one)."""
    messages: list[dict[str, Any]]
    """The trained branch as OpenAI chat messages, ending with its last reply."""
    trajectory: Trajectory
    """Its tokens: `prompt_ids`, `response_ids`, `loss_mask`, `logprobs`, `versions`,
    `turn_starts`, and the session's counters in `metadata`."""

    @property
    def response(self) -> str:
        """The last reply's content."""
        return self.trajectory.text

    @property
    def label(self) -> Any:
        return self.prompt.label

    @property
    def metadata(self) -> dict[str, Any]:
        return self.prompt.metadata


class AgentError(RuntimeError):
    """The agent failed, timed out, or made no model call."""


async def generate(ctx: GenerateContext, prompt: Prompt) -> Trajectory:
    """`rollout.generate_fn` for agents written against the OpenAI or Anthropic API."""
    options = parse_options(ctx.kwargs, AgentOptions)
    started = time.monotonic()
    gateway = current_gateway()
    async with contextlib.nullcontext(gateway) if gateway else serving() as gateway:
        session = gateway.open_session(
            ctx, options.session_options, tool_format=options.tool_format
        )
        try:
            with anyio.fail_after(options.timeout_s):
                result = await _run_agent(options, session, prompt)
        except TimeoutError:
            raise AgentError(
                f"the agent did not finish within timeout_s = {options.timeout_s:g}"
            ) from None
        finally:
            gateway.close_session(session)
    try:
        outcome = session.result()
    except RuntimeError as exc:
        raise AgentError(str(exc)) from None
    trajectory = outcome.trajectory
    if isinstance(result, str):
        trajectory.text = result
    await _reward(options, Episode(prompt, result, outcome.messages, trajectory), result)
    if options.episode_log:
        log_episode(options.episode_log, prompt, trajectory, time.monotonic() - started)
    return trajectory


generate.uses_gateway = True
"""`streamrl _rollout` starts one gateway for the process when the generate function says so."""
generate.needs_chat_template = True
"""Every call is rendered with the tokenizer's chat template (`streamrl check` asks for one)."""


async def _reward(options: AgentOptions, episode: Episode, result: Any) -> None:
    trajectory = episode.trajectory
    if options.episode_reward:
        fn = import_object(options.episode_reward, "rollout.generate_kwargs.episode_reward")
        outcome = await score(fn, episode, timeout_s=options.reward_timeout_s)
        trajectory.reward = outcome.reward
        trajectory.reward_error = outcome.error
        trajectory.metadata.update({f"reward/{k}": v for k, v in outcome.metrics.items()})
    elif isinstance(result, dict) and isinstance(result.get("reward"), int | float):
        trajectory.reward = float(result["reward"])


async def _run_agent(options: AgentOptions, session: Session, prompt: Prompt) -> Any:
    if options.command:
        return await run_process(options, session, prompt)
    fn = import_object(options.agent, "rollout.generate_kwargs.agent")
    if not callable(fn):
        raise TypeError(f"rollout.generate_kwargs.agent: {options.agent} is not callable")
    base_url = session.openai_base_url if options.api == "openai" else session.anthropic_base_url
    if inspect.iscoroutinefunction(fn):
        return await fn(base_url, prompt, **options.agent_kwargs)
    return await anyio.to_thread.run_sync(
        lambda: fn(base_url, prompt, **options.agent_kwargs),
        abandon_on_cancel=True,
        limiter=_AGENT_THREADS,
    )


def prompt_json(prompt: Prompt) -> bytes:
    record = {
        "text": prompt.text,
        "label": prompt.label,
        "metadata": prompt.metadata,
        "seq": prompt.seq,
        "index": prompt.index,
        "epoch": prompt.epoch,
    }
    return msgspec.json.encode(record)


async def run_process(options: AgentOptions, session: Session, prompt: Prompt) -> Any:
    """One episode's agent process (see the module docstring); its result file's JSON."""
    line = prompt_json(prompt)
    with tempfile.TemporaryDirectory(prefix="streamrl-agent-") as tmp:
        result_path, output_path = Path(tmp) / "result.json", Path(tmp) / "output.log"
        env = {
            **os.environ,
            **options.env,
            "OPENAI_BASE_URL": session.openai_base_url,
            "OPENAI_API_KEY": session.session_id,
            "ANTHROPIC_BASE_URL": session.anthropic_base_url,
            "ANTHROPIC_API_KEY": session.session_id,
            "STREAMRL_SESSION": session.session_id,
            "STREAMRL_PROMPT": line.decode(),
            "STREAMRL_RESULT_FILE": str(result_path),
        }
        argv = [part.replace("{python}", sys.executable) for part in options.command]
        with output_path.open("wb") as output:
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=output,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                cwd=options.cwd or None,
                preexec_fn=die_with_parent,
            )
        try:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                process.stdin.write(line + b"\n")
                await process.stdin.drain()
                process.stdin.close()
            code = await process.wait()
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)  # the whole group, finished or not
            with anyio.CancelScope(shield=True):
                await process.wait()
        if code != 0:
            tail = output_path.read_text(errors="replace")[-2000:]
            raise AgentError(f"agent process {options.command} exited with {code}:\n{tail}")
        if not result_path.exists():
            return None
        text = result_path.read_text()
        try:
            return json.loads(text)
        except ValueError:
            return text
