"""Prompts from the data set's rows: chat rendering, and a resumable stream.

A `PromptSource` hands out an endless stream of prompts. Stream position
`seq` (0, 1, 2, ...) maps to a row as

    epoch = seq // num_rows
    row   = order(epoch)[seq % num_rows]

where `order(epoch)` is a permutation seeded by `seed + epoch` when shuffling
is on and the identity otherwise. So a prompt is named by its `seq` alone and
a resume needs only a `DataPosition` (`streamrl.queues.accounting`, beside the
fates of the seqs it is built from): the low-water mark `next_seq` (every seq below it
is done) plus the few done seqs above it (`skip`), which arise because async rollouts
finish out of order. `position_after` builds one from the seqs a checkpoint has
trained, so a resume repeats no trained prompt and loses no untrained one.

Every row is parsed and validated when the source is built (`streamrl.data.rows`; errors
carry `path:line:`); rendering and tokenizing happen lazily, one prompt at a time.

BOS handling: a chat template writes every special token the model expects
(SmolLM2's starts with `<|im_start|>`, Llama 3's with `<|begin_of_text|>`),
so a rendered chat prompt is tokenized with `add_special_tokens=False`, which
never doubles a BOS. A raw prompt (`apply_chat_template = false`) is tokenized
with `add_special_tokens=True`, so the tokenizer adds its BOS if it has one,
as in pretraining.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable
from typing import Any, Literal

from streamrl.data.rows import DataError, Row, checked_rows
from streamrl.queues.accounting import DataPosition, position_after
from streamrl.types import Prompt

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- rendering


def render_prompt(
    tokenizer: Any,
    value: str | list[dict[str, str]],
    *,
    apply_chat_template: bool,
    system_prompt: str,
) -> str:
    """Prompt text as the model sees it.

    With the template, a string becomes [system (if `system_prompt`), user] and
    a message list is used as given; the generation prompt is appended.
    Without it, a string is used verbatim and a message list is an error.
    """
    if not apply_chat_template:
        if not isinstance(value, str):
            raise DataError("a chat-message prompt needs data.apply_chat_template = true")
        return value
    if isinstance(value, str):
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": value})
    else:
        messages = value
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def tokenize_prompt(tokenizer: Any, text: str, *, apply_chat_template: bool) -> list[int]:
    """Token ids of rendered text; special tokens added only when no template wrote them."""
    encoded = tokenizer(text, add_special_tokens=not apply_chat_template)
    return list(encoded["input_ids"])


# ---------------------------------------------------------------- the source


class PromptSource:
    """An endless, resumable stream of rendered prompts over one data set."""

    def __init__(
        self,
        path: str,
        *,
        tokenizer: Any,
        input_key: str = "prompt",
        label_key: str = "label",
        metadata_key: str = "metadata",
        apply_chat_template: bool = True,
        system_prompt: str = "",
        shuffle: bool = True,
        seed: int = 0,
        on_bad_line: Literal["error", "skip"] = "error",
        max_prompt_tokens: int = 0,
        position: DataPosition | None = None,
    ) -> None:
        if on_bad_line not in ("error", "skip"):
            raise ValueError(f"on_bad_line must be 'error' or 'skip', got {on_bad_line!r}")
        if apply_chat_template and not getattr(tokenizer, "chat_template", None):
            raise DataError(
                f"{path}: the tokenizer has no chat template; set data.apply_chat_template = false"
            )
        self.path = path
        self.tokenizer = tokenizer
        self.apply_chat_template = apply_chat_template
        self.system_prompt = system_prompt
        self.shuffle = shuffle
        self.seed = seed
        self.max_prompt_tokens = max_prompt_tokens
        self.num_skipped = 0
        """Bad rows skipped at load (on_bad_line = "skip")."""
        self.num_too_long = 0
        """Prompts skipped by next() for exceeding max_prompt_tokens."""
        self.too_long_seqs: set[int] = set()
        """Seqs skipped for length; done for good (see `resume_position`)."""
        self._rows = self._load(path, input_key, label_key, metadata_key, on_bad_line)
        self._orders: dict[int, list[int]] = {}
        self._start = position or DataPosition()
        self._next_seq = self._start.next_seq
        self._skip = set(self._start.skip)

    @classmethod
    def from_config(
        cls, cfg: Any, tokenizer: Any, *, seed: int, position: DataPosition | None = None
    ) -> PromptSource:
        """Build from a `DataConfig` (`seed` is `train.seed`)."""
        return cls(
            cfg.path,
            tokenizer=tokenizer,
            input_key=cfg.input_key,
            label_key=cfg.label_key,
            shuffle=cfg.shuffle,
            seed=seed,
            position=position,
            **_rendering(cfg),
        )

    @classmethod
    def for_eval(cls, dataset: Any, data: Any, tokenizer: Any) -> PromptSource:
        """An unshuffled source for an `EvalDataset`, rendered like the training `DataConfig`."""
        return cls(
            dataset.path,
            tokenizer=tokenizer,
            input_key=dataset.input_key,
            label_key=dataset.label_key,
            shuffle=False,
            **_rendering(data),
        )

    def _load(self, path, input_key, label_key, metadata_key, on_bad_line) -> list[Row]:
        rows: list[Row] = []
        for _, row in checked_rows(
            path,
            input_key=input_key,
            label_key=label_key,
            metadata_key=metadata_key,
            allow_messages=self.apply_chat_template,
        ):
            if isinstance(row, Row):
                rows.append(row)
                continue
            if on_bad_line == "error":
                raise row
            self.num_skipped += 1
            log.warning("skipping bad row (%d so far): %s", self.num_skipped, row)
        if not rows:
            reason = f"all {self.num_skipped} rows were bad" if self.num_skipped else "no rows"
            raise DataError(f"{path}: {reason}")
        return rows

    def __len__(self) -> int:
        return len(self._rows)

    def _order(self, epoch: int) -> list[int]:
        order = self._orders.get(epoch)
        if order is None:
            order = list(range(len(self._rows)))
            if self.shuffle:
                random.Random(self.seed + epoch).shuffle(order)
            if len(self._orders) >= 2:  # next() moves forward; keep this epoch and the last
                self._orders.pop(min(self._orders))
            self._orders[epoch] = order
        return order

    def locate(self, seq: int) -> tuple[int, int]:
        """(epoch, row index) of stream position `seq`."""
        if seq < 0:
            raise ValueError(f"seq must be >= 0, got {seq}")
        epoch, offset = divmod(seq, len(self._rows))
        return epoch, self._order(epoch)[offset]

    def get(self, seq: int) -> Prompt:
        """The prompt at stream position `seq`, rendered and tokenized."""
        epoch, index = self.locate(seq)
        row = self._rows[index]
        text = render_prompt(
            self.tokenizer,
            row.value,
            apply_chat_template=self.apply_chat_template,
            system_prompt=self.system_prompt,
        )
        input_ids = tokenize_prompt(
            self.tokenizer, text, apply_chat_template=self.apply_chat_template
        )
        return Prompt(
            seq=seq,
            index=index,
            epoch=epoch,
            text=text,
            input_ids=input_ids,
            label=row.label,
            metadata=dict(row.metadata),
        )

    def next(self) -> Prompt:
        """The next prompt of the stream (endless: epochs follow one another)."""
        while True:
            seq = self._next_seq
            self._next_seq += 1
            if seq in self._skip:
                self._skip.discard(seq)
                continue
            prompt = self.get(seq)
            if self.max_prompt_tokens and len(prompt.input_ids) > self.max_prompt_tokens:
                self.num_too_long += 1
                self.too_long_seqs.add(seq)
                log.warning(
                    "%s: row %d (seq %d) has %d prompt tokens > data.max_prompt_tokens = %d; "
                    "skipped (%d so far)",
                    self.path,
                    prompt.index,
                    seq,
                    len(prompt.input_ids),
                    self.max_prompt_tokens,
                    self.num_too_long,
                )
                continue
            return prompt

    @property
    def position(self) -> DataPosition:
        """Where the stream stands: the next seq to hand out and the skips still pending."""
        next_seq = self._next_seq
        return DataPosition(next_seq=next_seq, skip=sorted(s for s in self._skip if s >= next_seq))

    def resume_position(self, trained_seqs: Iterable[int]) -> DataPosition:
        """Checkpoint position: `position_after` over `trained_seqs` (handed out by this
        source since it was built), the position it started from, and its length skips."""
        return position_after(set(trained_seqs) | self.too_long_seqs, since=self._start)


def _rendering(data: Any) -> dict[str, Any]:
    """What a `DataConfig` says about reading and rendering rows, as `PromptSource`'s keywords
    (the training source's and every eval source's)."""
    return {
        "metadata_key": data.metadata_key,
        "apply_chat_template": data.apply_chat_template,
        "system_prompt": data.system_prompt,
        "on_bad_line": data.on_bad_line,
        "max_prompt_tokens": data.max_prompt_tokens,
    }
