"""Benchmarks: measured side by side in one run, reports in Markdown (``docs/BENCHMARKS.md``).

Run each as a module from the repository root, e.g. ``python -m benchmarks.throughput --help``;
``python -m benchmarks.run_all`` runs them all. The kvpress comparison is ``benchmarks.kvpress``.
Nothing here is imported by the product (``pipeline``).
"""
