"""Agents for the gateway tests, written as users write them: against the real clients.

Importable as `gateway_agents:<name>` (in-process agents) and runnable as a script (an
agent process: `python tests/gateway_agents.py MODE`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

BASE_URLS: list[str] = []
"""Base URLs the in-process agents were given (tests read it)."""


async def two_turns(base_url: str, prompt, question: str = "Hi.") -> str:
    import openai

    BASE_URLS.append(base_url)
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        messages = [{"role": "user", "content": question}]
        for _ in range(2):
            reply = await client.chat.completions.create(model="any", messages=messages)
            messages += [reply.choices[0].message.model_dump(exclude_none=True)]
            messages += [{"role": "user", "content": "Again."}]
    return reply.choices[0].message.content


async def long_episode(
    base_url: str, prompt, turns: int, engine_url: str = "", model_dir: str = "", every: int = 3
) -> str:
    """`turns` model calls; with `engine_url`, the engine's weights are reloaded as a new
    version after every `every` turns (as the trainer's updates would land)."""
    import httpx
    import openai

    async with (
        openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client,
        httpx.AsyncClient(timeout=60) as http,
    ):
        messages = [{"role": "user", "content": "Count with me."}]
        for turn in range(turns):
            reply = await client.chat.completions.create(model="any", messages=messages)
            messages += [reply.choices[0].message.model_dump(exclude_none=True)]
            messages += [{"role": "user", "content": f"Turn {turn + 2}."}]
            if engine_url and (turn + 1) % every == 0:
                version = str((turn + 1) // every)
                body = {"model_path": model_dir, "weight_version": version}
                (
                    await http.post(f"{engine_url}/update_weights_from_disk", json=body)
                ).raise_for_status()
    return reply.choices[0].message.content


def synchronous(base_url: str, prompt) -> dict:
    """An agent on the synchronous client (it runs in a worker thread)."""
    import openai

    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": "x"}])
    return {"reward": 0.5}


async def no_calls(base_url: str, prompt) -> str:
    return "I answer without asking the model."


def episode_reward(episode) -> dict:
    """Scores the whole episode: its number of messages and model turns."""
    return {"reward": len(episode.messages) / 10, "turns": episode.trajectory.num_turns}


def failing_reward(episode) -> float:
    raise RuntimeError("the verifier is down")


def _process(mode: str) -> None:
    line = sys.stdin.readline()
    assert json.loads(line) == json.loads(os.environ["STREAMRL_PROMPT"])
    prompt = json.loads(line)
    if mode == "fail":
        print("something went wrong in the agent", flush=True)
        sys.exit(3)
    if mode == "hang":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        with open(os.environ["PIDS_FILE"], "w") as handle:
            handle.write(f"{os.getpid()} {child.pid}")
        time.sleep(3600)
    import anthropic

    client = anthropic.Anthropic(max_retries=0)  # ANTHROPIC_BASE_URL / _API_KEY from the env
    messages = [{"role": "user", "content": prompt["text"]}]
    first = client.messages.create(model="any", max_tokens=4, messages=messages)
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": "More."},
    ]
    second = client.messages.create(model="any", max_tokens=4, messages=messages)
    result = {"answer": second.content[0].text, "label": prompt["label"]}
    with open(os.environ["STREAMRL_RESULT_FILE"], "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    _process(sys.argv[1])
