"""The compression core: pure tensors, no Ray, no files (see ``docs/ARCHITECTURE.md``).

* :mod:`~pipeline.kv.config` -- :class:`CompressionConfig` and the method spelling;
* :mod:`~pipeline.kv.parts` and the registries :data:`~pipeline.kv.scorers.SCORERS`,
  :data:`~pipeline.kv.allocation.ALLOCATIONS`, :data:`~pipeline.kv.selection.SELECTIONS`;
* :mod:`~pipeline.kv.compress` -- the per-layer :class:`Compressor`;
* :mod:`~pipeline.kv.store`, :mod:`~pipeline.kv.cache`, :mod:`~pipeline.kv.capture`,
  :mod:`~pipeline.kv.decode_cap` -- the variable-length cache and what it does over time;
* :mod:`~pipeline.kv.attention`, :mod:`~pipeline.kv.varlen_kernels` -- attention over it.
"""
