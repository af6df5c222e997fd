"""``nsd bench``: speed and quality of AR, SD, NSD and typical acceptance on real datasets.

Modules: :mod:`~nsd.bench.datasets` (prompts), :mod:`~nsd.bench.methods` (the method
grid), :mod:`~nsd.bench.runner` (the timed, interleaved loop), :mod:`~nsd.bench.store`
(journal and atomic writes), :mod:`~nsd.draftlen.cpu_load` (other-process CPU load),
:mod:`~nsd.bench.metrics` (pure aggregation, beside :mod:`nsd.aggregate`), :mod:`~nsd.bench.humaneval_exec` (pass@1),
:mod:`~nsd.bench.hf_peers` (transformers' assisted and prompt-lookup decoding),
:mod:`~nsd.bench.report` and :mod:`~nsd.bench.plots` (outputs), :mod:`~nsd.bench.cli`
(the ``nsd bench`` subcommand), :mod:`~nsd.bench.schedule` (method rotation, missing
calls) and :mod:`~nsd.bench.speed` (the one tokens/s, paired ratios).

The logic of the scripts in ``benchmarks/``, which are thin commands over it:
:mod:`~nsd.bench.frontier` (``frontier_reading.py``), :mod:`~nsd.bench.vllm_report`
(``vllm_bench.py``'s rows and report), :mod:`~nsd.bench.gpu_costs` and
:mod:`~nsd.bench.gpu_predict` (``gpu_costs.py``, ``gpu_predict.py``); ``paired_speedup.py``
reads through :mod:`~nsd.bench.speed`.
"""
