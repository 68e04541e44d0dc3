"""The experiments behind docs/evaluation.md: sweeps of simulator runs, their tables and figures.

Research scripts, not the library: they only use ``peerinfer.sim``'s public API. Run from the
repository root, ``python -m experiments NAME [--out DIR] [--jobs J] [--cache FILE]``.

``runner``     runs a list of configs in parallel, with a cache of finished runs
``sweeps``     the paper's experiments and the batching one (``all``)
``scenarios``  churn, mixed machines, gossipsub's mesh against broadcast (by name only)
``tables``     the markdown tables of docs/evaluation.md from the experiments' JSON files
"""
