"""The trainer side of the weight wire: each new version from the learner to the engines.

    publisher.py        WeightPublisher: stage, pause, send, continue, record, resync
    transport.py        WeightTransport: the steps a way of sending fills in; Staged
    group_transport.py  over weight-update groups (NCCL / gloo), one per pipeline stage
    update_groups.py      the groups it keeps over the live engines
    ipc_transport.py    by CUDA IPC handle, for engines on the learner's own GPU
    adapter_files.py    LoRA adapters as peft directories that SGLang engines load
    verify.py           digests: a bucket an engine received corrupted is sent again
    factory.py          the publisher and its transport, chosen from the config

The engines' side, and what both sides share (the group, the staging buffers, the IPC
payload, the stage channel), is `streamrl.weights`.
"""
