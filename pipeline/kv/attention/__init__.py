"""Attention over the compressing cache: :mod:`.registered` (the functions transformers calls, scoped
to a run by ``model.set_attn_implementation``, and the recording of attention inputs), :mod:`.dense`
(the attention math of a prefill and the reference and grouped decode paths), :mod:`.varlen_kernels`
(reading a ragged cache in place: blocked, flat, flash-attn's varlen, SDPA; chosen once per cache).
"""
