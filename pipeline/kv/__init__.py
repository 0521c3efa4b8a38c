"""The compression core: pure tensors, no Ray, no files (see ``docs/ARCHITECTURE.md``).

* :mod:`~pipeline.kv.config` -- :class:`CompressionConfig` and the method spelling;
* :mod:`~pipeline.kv.parts` and the registries :data:`~pipeline.kv.scorers.SCORERS`,
  :data:`~pipeline.kv.allocation.ALLOCATIONS`, :data:`~pipeline.kv.selection.SELECTIONS`;
* :mod:`~pipeline.kv.compress` -- the per-layer :class:`Compressor`;
* :mod:`~pipeline.kv.store`, :mod:`~pipeline.kv.cache`, :mod:`~pipeline.kv.decode_cap` -- the
  variable-length cache: storage, decode steps, rollback;
* :mod:`~pipeline.kv.prefill` -- how a context is prefilled into it (one strategy per module, the
  rules in :mod:`~pipeline.kv.prefill.rules`), and the sweep's capture;
* :mod:`~pipeline.kv.attention`, :mod:`~pipeline.kv.varlen_kernels` -- attention over it.
"""
