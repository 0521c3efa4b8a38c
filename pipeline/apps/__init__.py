"""Entry points that compose the rooms below them (the jobs' command lines): batch jobs, the
compression sweep, the perturbation diagnostics, the HeadKV calibration. ``jobs/*.py`` only call
these ``main`` functions; nothing below ``apps`` imports it."""
