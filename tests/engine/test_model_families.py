"""GLM-4, Qwen3-MoE, GLM-4.5 MoE and DeepSeek-V3 in the torch backend and the embedded engine.

Both load any transformers causal LM; what these families add is the
checkpoint layout of MoE experts (per expert on disk and on the wire, fused in
transformers' memory) and the routers' correction-bias buffer.
"""

from __future__ import annotations

import itertools
import math

import pytest

torch = pytest.importorskip("torch")

from test_engine_core import (  # noqa: E402
    max_logprob_error,
    prompts,
    requests_for,
    running_engine,
)

from streamrl import models  # noqa: E402

FAMILIES = ("glm4-tiny", "qwen3-moe-tiny", "glm4-moe-tiny", "deepseek-v3-tiny")
pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_torch_thread")]


def checkpoint_of(model, directory) -> dict[str, torch.Tensor]:
    from streamrl.backends.megatron.convert import read_hf_state

    model.save_pretrained(directory)
    return read_hf_state(directory)


@pytest.mark.parametrize("name", FAMILIES)
def test_checkpoint_views_are_the_saved_checkpoint_and_write_through(name, tmp_path):
    model = models.build_random_model(name, seed=1)
    saved = checkpoint_of(model, tmp_path)
    views = models.checkpoint_views(model)
    tied_head = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert set(views) - tied_head == set(saved)
    assert all(torch.equal(views[key], value) for key, value in saved.items())
    expert = next((key for key in views if ".experts.3.up_proj." in key), None)
    if expert is not None:  # a view of the fused parameter: writing it changes the model
        with torch.no_grad():
            views[expert].fill_(0.25)
        assert torch.equal(checkpoint_of(model, tmp_path / "after")[expert], views[expert])


def _micro_batch(vocab_size: int):
    from streamrl.backends.base import MicroBatch

    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, vocab_size, (3, 12), generator=generator)
    attention = torch.ones(3, 12, dtype=torch.int64)
    attention[1, 9:] = 0
    loss_mask = attention.float()
    loss_mask[:, :3] = 0
    return MicroBatch(
        input_ids=input_ids * attention,
        attention_mask=attention,
        loss_mask=loss_mask,
        behaviour_logprobs=torch.zeros(3, 12),
        sample_indices=[0, 1, 2],
        advantages=torch.ones(3, 12),
        num_tokens_in_mini_batch=float(loss_mask.sum()),
        num_sequences_in_mini_batch=3,
    )


def _nll(micro_batch, logprobs, entropy):
    loss = -(logprobs * micro_batch.loss_mask).sum() / micro_batch.num_tokens_in_mini_batch
    return loss, {"nll": loss.detach()}


@pytest.mark.parametrize("name", FAMILIES)
def test_the_torch_backend_trains_each_family_and_publishes_checkpoint_names(name, tmp_path):
    from streamrl.backends.torch import TorchBackend
    from streamrl.config import LearnerConfig

    backend = TorchBackend(
        f"random:{name}", LearnerConfig(lr=1e-3), device=torch.device("cpu"), dtype=torch.float32
    )
    batch = _micro_batch(backend.model.config.vocab_size)
    losses = [
        backend.train_mini_batch([batch], _nll, temperature=1.0, need_entropy=False)["nll"]
        for _ in range(3)
    ]
    assert all(math.isfinite(loss) for loss in losses)
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    published = dict(backend.hf_weights())
    saved = checkpoint_of(backend.model, tmp_path)
    assert set(published) == set(saved)
    assert all(torch.equal(published[key], value) for key, value in saved.items())


@pytest.mark.parametrize("name", FAMILIES)
async def test_the_embedded_engine_serves_each_family_and_takes_checkpoint_named_updates(
    name, tmp_path
):
    """The transformers runner serves them (the compact runner does not); its logprobs are a
    teacher-forced forward's, before and after an update sent under the checkpoint's names."""
    requests = requests_for(prompts(4), max_new_tokens=6, ignore_eos=True)
    update_source = models.build_random_model(name, seed=5).eval()
    update = checkpoint_of(update_source, tmp_path)
    with running_engine(f"random:{name}") as engine:
        assert engine.model_info["runner"] == "hf"
        before = await engine.generate(requests)
        await engine.update_weights(update.items(), "5")
        after = await engine.generate(requests)
    reference = models.load_causal_lm(f"random:{name}")
    assert max_logprob_error(reference, requests, before) <= 1e-4
    assert all(set(output.versions) == {"5"} for output in after)
    assert max_logprob_error(update_source, requests, after) <= 1e-4
