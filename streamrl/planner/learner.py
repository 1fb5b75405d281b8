"""What one learner GPU holds, term by term: the model's state and one micro-batch's work.

Each term is bytes on one GPU, from a `ModelShape` and a `LearnerSetup` (pure arithmetic, no
torch). The dtypes are the backends' own:

| | torch backend | megatron backend |
| --- | --- | --- |
| weights | float32 (the master copy; bf16 autocast computes) | `learner.dtype` (bf16 on CUDA) |
| gradients | float32 | float32 (`grad_reduce_in_fp32`) |
| master weights | none (the weights are float32) | float32, split over DP (distributed optimizer) |
| Adam moments | 2 x float32 | 2 x float32, split over DP (distributed optimizer) |
| step temporaries | float32 sqrt(v) of every parameter (torch's foreach Adam) | the same, of its shard |
| KL reference | `learner.dtype` | `learner.dtype` |

With LoRA the base is frozen in the compute dtype and only the adapters train. Activation
and logits terms are per micro-batch of `tokens` = max(learner.micro_batch_tokens, the
longest sequence): a micro-batch holds up to that many tokens, padding included, in either
layout (`backends.batching`: right-padded rows, or packed rows). Packing changes no
per-token term: a packed row is one sequence of that width to every layer, and its
attention keeps no mask (`backends.documents`: variable-length flash attention on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass

from streamrl.backends.megatron.memory import Parallelism, expert_parameters
from streamrl.backends.megatron.shapes import ModelShape

FP32 = 4
ADAM_MOMENTS = 2  # exp_avg and exp_avg_sq, float32 each
MEGATRON_LOGPROB_CHUNK_BYTES = 256 * 2**20  # streamrl.backends.megatron.logprobs.CHUNK_BYTES


@dataclass(frozen=True)
class LearnerSetup:
    """The learner config as the memory terms read it."""

    backend: str  # "torch" or "megatron"
    layout: Parallelism
    compute_bytes: int  # 2 for bf16, 4 for float32
    tokens: int  # padded tokens of the largest micro-batch
    recompute: bool = False  # learner.gradient_checkpointing
    recompute_layers: int = 0  # learner.megatron.recompute_layers: of a stage; 0 = every layer
    reference: bool = False  # a KL reference model (algorithm.kl_loss_coef > 0, no LoRA)
    distributed_optimizer: bool = True  # megatron only
    sequence_parallel: bool = False  # megatron only
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()

    @property
    def weight_bytes(self) -> int:
        """Bytes per weight held: float32 for the torch backend's trained model, else compute."""
        if self.backend == "torch" and not self.lora_rank:
            return FP32
        return self.compute_bytes


# ---- parameters per GPU


def local_parameters(shape: ModelShape, layout: Parallelism) -> tuple[float, float]:
    """(dense, expert) parameters on one GPU: dense / (tp * pp), experts / (tp * pp * ep).
    Pipeline stages are taken as equal (the first holds the embedding, the last the head)."""
    experts = expert_parameters(shape)
    dense = shape.num_parameters() - experts
    model_parallel = layout.tp * layout.pp
    return dense / model_parallel, experts / (model_parallel * layout.ep)


def lora_parameters(shape: ModelShape, rank: int, targets: tuple[str, ...]) -> int:
    """Adapter parameters: rank * (in + out) per targeted linear per layer (dense layers)."""
    hidden, ffn = shape.hidden_size, shape.ffn_hidden_size
    query, key_value = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    sizes = {
        "q_proj": (hidden, query), "k_proj": (hidden, key_value), "v_proj": (hidden, key_value),
        "o_proj": (query, hidden), "gate_proj": (hidden, ffn), "up_proj": (hidden, ffn),
        "down_proj": (ffn, hidden), "gate_up_proj": (hidden, 2 * ffn),
    }  # fmt: skip
    return shape.num_layers * sum(rank * sum(sizes[name]) for name in targets)


def trained_parameters(shape: ModelShape, setup: LearnerSetup) -> float:
    """Parameters with a gradient on one GPU: the local shard, or the adapters with LoRA."""
    if setup.lora_rank:
        layout = setup.layout
        return lora_parameters(shape, setup.lora_rank, setup.lora_targets) / (layout.tp * layout.pp)
    return sum(local_parameters(shape, setup.layout))


def weight_staging(shape: ModelShape, setup: LearnerSetup) -> int:
    """The publisher's staging buffers on its GPU (`streamrl.weights.staging`), allocated at
    the first push and reused: every tensor the engines receive from its pipeline stage, in
    the compute dtype (the adapters alone with LoRA)."""
    if setup.lora_rank:
        return int(trained_parameters(shape, setup) * setup.layout.tp * setup.compute_bytes)
    return int(shape.num_parameters() / setup.layout.pp * setup.compute_bytes)


def optimizer_parameters(shape: ModelShape, setup: LearnerSetup) -> float:
    """Parameters whose optimizer state lives on one GPU. Megatron's distributed optimizer
    splits the dense ones over the DP ranks and the experts' over the expert-DP ranks
    (dp / ep); the torch backend and `use_distributed_optimizer = false` keep them all."""
    if setup.lora_rank or setup.backend == "torch" or not setup.distributed_optimizer:
        return trained_parameters(shape, setup)
    dense, experts = local_parameters(shape, setup.layout)
    layout = setup.layout
    return dense / layout.dp + experts / (layout.dp / layout.ep)


# ---- the model's state


def weights(shape: ModelShape, setup: LearnerSetup) -> int:
    """Every local parameter at `setup.weight_bytes` (4 for the torch backend, else 2 in bf16)."""
    return int(sum(local_parameters(shape, setup.layout)) * setup.weight_bytes)


def gradients(shape: ModelShape, setup: LearnerSetup) -> int:
    """4 bytes per trained parameter: torch's float32 .grad, Megatron's float32 main_grad."""
    return int(trained_parameters(shape, setup) * FP32)


def master_weights(shape: ModelShape, setup: LearnerSetup) -> int:
    """Megatron with 16-bit weights: a float32 copy of its optimizer shard (4 bytes each)."""
    if setup.backend != "megatron" or setup.compute_bytes == FP32:
        return 0
    return int(optimizer_parameters(shape, setup) * FP32)


def adam_moments(shape: ModelShape, setup: LearnerSetup) -> int:
    """Adam's exp_avg and exp_avg_sq, float32: 8 bytes per parameter of the optimizer shard."""
    return int(optimizer_parameters(shape, setup) * ADAM_MOMENTS * FP32)


def optimizer_step_temporaries(shape: ModelShape, setup: LearnerSetup) -> int:
    """During `optimizer.step()` only: torch's foreach Adam(W) allocates sqrt(exp_avg_sq) for
    the whole shard at once (4 bytes per parameter), Megatron's fallback optimizer too."""
    return int(optimizer_parameters(shape, setup) * FP32)


def reference_weights(shape: ModelShape, setup: LearnerSetup) -> int:
    """The frozen KL reference in the compute dtype (LoRA's reference is the base itself)."""
    if not setup.reference or setup.lora_rank:
        return 0
    return int(sum(local_parameters(shape, setup.layout)) * setup.compute_bytes)


def model_state(shape: ModelShape, setup: LearnerSetup) -> int:
    """What the model holds before any micro-batch: weights, gradients, master weights, Adam
    moments and the KL reference (Megatron in bf16: 6 B per local parameter plus 12 B per
    parameter of the optimizer shard, plus 2 B with a reference)."""
    return sum(
        term(shape, setup)
        for term in (weights, gradients, master_weights, adam_moments, reference_weights)
    )


def autocast_weight_copies(shape: ModelShape, setup: LearnerSetup) -> int:
    """Torch backend under bf16 autocast: every float32 weight's bf16 cast is cached for the
    forward and saved for the backward, 2 bytes per parameter from the forward's end until
    the backward has passed its layer."""
    if setup.backend != "torch" or setup.lora_rank or setup.compute_bytes == FP32:
        return 0
    return int(shape.num_parameters() * setup.compute_bytes)


# ---- one micro-batch


def mlp_width(shape: ModelShape) -> float:
    """The MLP's hidden width a token passes through, averaged over the layers: ffn in a
    dense layer; top_k x expert_ffn + the shared expert's in an MoE layer (with balanced
    routing, a GPU's experts see top_k / ep of the tokens of every EP rank: the same)."""
    if shape.moe is None:
        return shape.ffn_hidden_size
    moe = shape.moe
    routed = moe.top_k * moe.expert_ffn_hidden_size + moe.shared_ffn_hidden_size
    widths = [routed if is_moe else shape.ffn_hidden_size for is_moe in moe.layer_is_moe]
    return sum(widths) / len(widths)


def hf_layer_activation_bytes_per_token(shape: ModelShape, compute_bytes: int) -> float:
    """Bytes one transformers decoder layer saves for the backward per token (torch backend).

    The residual stream is float32 (float32 weights), matmuls run in bf16 under autocast.
    With h = hidden, q = heads * head_dim, f = ffn, c = compute bytes, r = 4:
    two RMSNorms save their input and output (4 r h); q/k/v and gate/up each cast their
    input (5 c h, none in float32); attention keeps the rotated query, key and value
    expanded to every head (transformers' repeat_kv when a padding mask is passed), its
    output and the output projection's contiguous input (5 c q); the MLP keeps gate, up,
    silu(gate) and their product (4 c f, f = `mlp_width`). Qwen3's q/k RMSNorm adds
    2 r (q + kv), GLM-4's post norms 4 r h."""
    hidden, ffn = shape.hidden_size, mlp_width(shape)
    query = shape.num_heads * shape.head_dim
    key_value = shape.num_kv_heads * shape.head_dim
    casts = 5 * compute_bytes * hidden if compute_bytes != FP32 else 0
    total = 4 * FP32 * hidden + casts + 5 * compute_bytes * query + 4 * compute_bytes * ffn
    if shape.qk_norm:
        total += 2 * FP32 * (query + key_value)
    if shape.post_norms:
        total += 4 * FP32 * hidden
    return total


def megatron_layer_activation_bytes_per_token(shape: ModelShape, setup: LearnerSetup) -> float:
    """Bytes one Megatron decoder layer saves for the backward per token on one GPU.

    Everything in the compute dtype c; q, kv and f split over TP (t), the h terms too with
    sequence parallelism (s): the two norms' and two column-parallel linears' inputs
    (4 c h / s); the fused qkv output, kept alive by the value view SDPA saves (c (q + 2 kv));
    the rotated query and key (c (q + kv)); SDPA's output and the projection's reshaped
    input (2 c q); fc1's gate|up output and swiglu's output (3 c f, f = `mlp_width`); the
    log-sum-exp (4 bytes per head). GLM-4's post norms add 2 c h / s. MoE routing buffers
    (permuted tokens, probabilities) are not counted."""
    c, t = setup.compute_bytes, setup.layout.tp
    s = t if setup.sequence_parallel else 1
    hidden, ffn = shape.hidden_size, mlp_width(shape)
    query = shape.num_heads * shape.head_dim
    key_value = shape.num_kv_heads * shape.head_dim
    per_hidden = (6 if shape.post_norms else 4) * c * hidden / s
    return per_hidden + (c * (4 * query + 3 * key_value + 3 * ffn) + FP32 * shape.num_heads) / t


def layer_input_bytes_per_token(shape: ModelShape, setup: LearnerSetup) -> float:
    """What full recompute keeps of each layer: its input (float32 residual for the torch
    backend, compute dtype / sequence-parallel share for Megatron)."""
    if setup.backend == "torch":
        return FP32 * shape.hidden_size
    s = setup.layout.tp if setup.sequence_parallel else 1
    return setup.compute_bytes * shape.hidden_size / s


def layer_activation_bytes_per_token(shape: ModelShape, setup: LearnerSetup) -> float:
    if setup.backend == "torch":
        return hf_layer_activation_bytes_per_token(shape, setup.compute_bytes)
    return megatron_layer_activation_bytes_per_token(shape, setup)


def activations(shape: ModelShape, setup: LearnerSetup) -> int:
    """Saved activations at the backward's start on the busiest GPU: tokens x layers of one
    stage x micro-batches in flight (1F1B keeps pp of them on the first stage) x the layer's
    bytes per token. With `learner.gradient_checkpointing` a recomputed layer keeps its input
    only, and one layer at a time holds its full activations again in the backward: every
    layer (the default), or the first `learner.megatron.recompute_layers` of each stage
    while the others keep theirs."""
    layers = shape.num_layers  # L / pp layers of a stage x pp micro-batches in flight
    full = layer_activation_bytes_per_token(shape, setup)
    recomputed = 0
    if setup.recompute:
        stage_layers = layers // setup.layout.pp
        recomputed = (setup.recompute_layers or stage_layers) * setup.layout.pp
    kept = layers - recomputed
    per_token = recomputed * layer_input_bytes_per_token(shape, setup) + max(kept, 1) * full
    return int(setup.tokens * per_token)


def activation_gradients(shape: ModelShape, setup: LearnerSetup) -> int:
    """The backward's working set while it passes one layer: gradients as large as that
    layer's saved activations (an upper bound; Megatron frees each as it goes)."""
    return int(setup.tokens * layer_activation_bytes_per_token(shape, setup))


def logits(shape: ModelShape, setup: LearnerSetup) -> int:
    """The output head's logits and their gradient at the backward's start.

    torch backend: the head runs only on trained positions (at most every token): bf16
    logits, the float32 chunks `algorithms.logits.logprobs_of_rows` keeps for the backward,
    and the logits' gradient, (2 c + 4) V per token. Megatron: vocabulary-parallel logits
    for every position and their gradient, 2 c V / tp per token, plus the chunked log-prob
    path's float32 working set (one `CHUNK_BYTES`); no float32 copy outlives its chunk."""
    vocab = shape.vocab_size
    if setup.backend == "torch":
        return int(setup.tokens * vocab * (2 * setup.compute_bytes + FP32))
    per_token = 2 * setup.compute_bytes * vocab / setup.layout.tp
    return int(setup.tokens * per_token + MEGATRON_LOGPROB_CHUNK_BYTES)


def forward_logits(shape: ModelShape, setup: LearnerSetup) -> int:
    """A forward-only pass's logits (the proximal and reference log-probabilities), with no
    gradient: the logits themselves and a float32 chunk of rows."""
    per_token = setup.compute_bytes * shape.vocab_size / setup.layout.tp
    return int(setup.tokens * per_token + MEGATRON_LOGPROB_CHUNK_BYTES)
