"""The compression core: pure tensors, no Ray, no files, nothing of the package outside it (see
``docs/ARCHITECTURE.md``). At this level, the method: :mod:`~pipeline.kv.config` (:class:`CompressionConfig`
and the method spelling), :mod:`~pipeline.kv.parts` and its registries (:mod:`~pipeline.kv.scorers`,
:mod:`~pipeline.kv.allocation`, :mod:`~pipeline.kv.selection`), :mod:`~pipeline.kv.phases`,
:mod:`~pipeline.kv.compress` (the :class:`Compressor`: context -> score -> allocate -> select) and the
helpers the parts share (value norms, ranking, RoPE, the learned scorer's weights). Sub-packages:

* :mod:`~pipeline.kv.prefill` -- how a context is prefilled into the cache (one strategy per module,
  every rule in :mod:`~pipeline.kv.prefill.rules`), the sweep's capture, KVzip's passes (cache side);
* :mod:`~pipeline.kv.storage` -- the variable-length cache: storage, decode steps, rollback, rows
  leaving and joining, the decode-time cap;
* :mod:`~pipeline.kv.attention` -- the attention functions transformers calls and the kernels that read
  the cache in place.
"""
