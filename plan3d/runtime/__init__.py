"""The bundled 3D runtime: the only package of plan3d that imports torch.

One file per concern, read top to bottom (picotron style): `context` (process groups and the
DeviceMesh from the plan's rank map, placement check), `tp` (Megatron tensor + sequence
parallelism), `model` (the GPT decoder as pipeline stage modules), `pipeline` (1F1B /
interleaved through torch.distributed.pipelining), `dp` (ZeRO 0-3), `mixed` (bf16 mixed
precision for ZeRO 0-2), `clip`, `data`, `checkpoint` (DCP, atomic, reshardable), `memory`,
`comm`, `train` (the loop) and `worker` (the process torchrun starts). See docs/runtime.md.
"""
