"""``nsd bench``: speed and quality of AR, SD, NSD and typical acceptance on real datasets.

Modules: :mod:`~nsd.bench.datasets` (prompts), :mod:`~nsd.bench.methods` (the method
grid), :mod:`~nsd.bench.runner` (the timed, interleaved loop), :mod:`~nsd.bench.store`
(journal and atomic writes), :mod:`~nsd.load` (other-process CPU load),
:mod:`~nsd.bench.metrics` (pure aggregation, beside :mod:`nsd.aggregate`),
:mod:`~nsd.bench.humaneval_exec` (pass@1), :mod:`~nsd.bench.hf_peers` (transformers'
assisted and prompt-lookup decoding), :mod:`~nsd.bench.report` and
:mod:`~nsd.bench.plots` (outputs), :mod:`~nsd.bench.cli` (the ``nsd bench`` subcommand).
"""
