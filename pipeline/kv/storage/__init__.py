"""The compressed cache's storage: :mod:`.store` (one layer's variable-length segments in flat buffers,
and the one footprint rule, ``segment_bytes``), :mod:`.cache` (the transformers ``Cache`` subclass:
routes a prefill to its strategy, then appends, decode attention, rollback and accounting), :mod:`.rows`
(rows leaving and joining a decode batch's cache), :mod:`.decode_cap` (the optional decode-time cap).
"""
