"""The megatron-core learner backend (see docs/megatron.md).

Modules, each importable on its own and none imported here (so `import
streamrl.backends.megatron` stays free of torch and Megatron):

- `shapes`, `families`: what an HF config means (Llama, Qwen2/3, GLM-4, Qwen3-MoE,
  GLM-4.5, DeepSeek-V3)
- `model`: GPTModel from an HF config (its layer spec and TransformerConfig)
- `layers`: the modules put into it: SDPA core attention, sequence-parallel norms, GLM-4's
  post-norm linear, the critic's value head
- `moe`, `mla`, `grouped_experts`: mixture-of-experts and latent-attention pieces
- `rules`: which Megatron tensor is made of which HF tensors, stage by stage
- `convert`: HF <-> Megatron weights by those rules (fused QKV, gate/up, TP shards, PP
  stages, EP ranks), and the HF files
- `export`: a stage's full tensors gathered over TP and EP
- `routing`: MoE routing replay and router agreement
- `parallel`: process groups on gloo or NCCL, this rank's Layout
- `memory`: which layouts split a model (`streamrl check`), bytes per learner and engine GPU
- `cpu_shims`: every CUDA-only workaround needed to run on CPU
- `logprobs`: vocabulary-parallel per-token log-probabilities and entropy
- `batches`: micro-batches from rank 0 to all ranks, results back
- `schedule`: Megatron's forward(-backward) schedule over a step's micro-batches
- `backend`: MegatronBackend, the LearnerBackend implementation
- `critic`: the value model of GAE, in the policy's layout
- `lora`: LoRA adapters around column- and row-parallel linears
- `checkpoint`: the policy's and the critic's checkpoints, per-rank optimizer state
"""
