"""The megatron-core learner backend (see docs/megatron.md).

Modules, each importable on its own and none imported here (so `import
streamrl.backends.megatron` stays free of torch and Megatron):

- `model`: GPTModel from an HF config (Llama / Qwen2 / Qwen3), SDPA core attention
- `convert`: HF <-> Megatron weights (fused QKV, gate/up, TP shards, PP stages)
- `parallel`: process groups on gloo or NCCL, this rank's Layout
- `cpu_shims`: every CUDA-only workaround needed to run on CPU
- `logprobs`: vocabulary-parallel per-token log-probabilities and entropy
- `batches`: micro-batches from rank 0 to all ranks, results back
- `backend`: MegatronBackend, the LearnerBackend implementation
- `launch`: starting learner ranks and the torch.distributed rendezvous
"""
