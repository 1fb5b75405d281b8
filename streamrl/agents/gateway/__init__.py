"""Agents written against the OpenAI or Anthropic API, trained unchanged.

A token-capturing API gateway per rollout process: each episode gets a session (a base
URL or API key), every call in it becomes a turn of one trajectory whose tokens are
exactly those the engine saw and produced. docs/agents.md ("Agents written against the
OpenAI and Anthropic APIs") is the user's guide.

| module | holds |
| --- | --- |
| `app.py` | `Gateway` (the aiohttp server and its sessions), `serving`, `current_gateway` |
| `sessions.py` | `Session`: matching calls to recorded history, token reuse, branches |
| `calls.py` | what a call asks (`ChatRequest`, `TextRequest`, `Sampling`) and gets (`Reply`) |
| `templates.py` | `ChatTemplate`: first-turn and continuation rendering, tool support |
| `tool_calls.py` | Hermes `<tool_call>` and Llama 3 JSON tool-call parsing |
| `messages.py` | the canonical `Message` both APIs become |
| `openai_api.py`, `anthropic_api.py` | request parsing, replies, stream chunks / events |
| `sse.py` | server-sent-event framing |
| `episode.py` | `generate` (the generate function), `AgentOptions`, `Episode` |
"""

from streamrl.agents.gateway.app import Gateway, current_gateway, serving
from streamrl.agents.gateway.episode import AgentOptions, Episode, generate
from streamrl.agents.gateway.sessions import Session, SessionOptions

__all__ = [
    "AgentOptions",
    "Episode",
    "Gateway",
    "Session",
    "SessionOptions",
    "current_gateway",
    "generate",
    "serving",
]
