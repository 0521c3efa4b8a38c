"""How a context is prefilled into a compressing cache: one strategy per module behind one seam.

:mod:`.rules` chooses the plan for a config (every rule about what goes together lives there);
:mod:`.base` is the seam (what a strategy does when a layer's K/V come in, when its attention runs,
after each forward and at the end; what it may touch of the cache); :mod:`.build` makes a plan into
its strategy. The strategies: :mod:`.one_pass` (the model's forward), :mod:`.layer_by_layer` (each
layer over the whole context in token slices), :mod:`.chunk_eviction` (chunks of the context, the cache
compressed after each); the layer steps they hand finished layers to: :mod:`.layers` (at once,
deferred) and :mod:`.streamed_budgets` (a cross-layer budget decided as the layers come), with
:mod:`.held` for choosing again among held entries; and :mod:`.capture`, the sweep's one dense prefill
for many settings. This package imports nothing here (the config imports :mod:`.rules`).
"""
