"""The bundled 3D runtime: the only package of plan3d that imports torch.

One file per concern, read top to bottom (picotron style): `context` (process groups and the
DeviceMesh from the plan's rank map), `tp` (Megatron tensor + sequence parallelism), `model` (the
GPT decoder split into pipeline stages), `pipeline` (1F1B / interleaved through
torch.distributed.pipelining), `dp` (ZeRO 0-3), `clip`, `data`, `checkpoint`, `memory`, and
`worker` (the process torchrun starts). See docs/runtime.md.
"""
