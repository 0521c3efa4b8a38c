"""Side by side with kvpress: ``python -m benchmarks.kvpress.vs_kvpress`` (see its docstring).

``side`` and ``side_tools`` run inside kvpress's own virtual environment, so nothing in this
package's ``__init__`` (nor the parent's) may import the product or heavy libraries.
"""
