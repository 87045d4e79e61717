"""Offline modelling of checkpointing: no training process, no snapshot, no extension.

- :mod:`.analysis`: the wasted-work model, periodic (Young/Daly) against just-in-time
  checkpointing with full restarts and with in-process restarts (closed forms, goodput).
- :mod:`.presets`: public failure rates (Llama 3, Meta's research clusters).
- :mod:`.restart`: the in-process restart's downtime as measured parts (detection,
  re-formation, spare take-over, restore), its growth with the job, the spare pool.
- :mod:`.simulate`: a seeded Monte-Carlo check of those closed forms (and Weibull failures).
- :mod:`.advice`: ``cudasnap advise``: one job's policies compared and a pick, on
  :mod:`.analysis`.

Call order: ``cudasnap advise`` (cudasnap.tools.cli) -> :func:`.advice.advise` ->
:mod:`.analysis`; ``bench/wasted_work.py``, ``bench/goodput.py`` and the tests call
:mod:`.analysis` and :mod:`.simulate` directly. The host-memory fit that ``cudasnap advise`` adds
(``cudasnap.core.host_fit``) stays in core. These modules import the standard library
and numpy only: nothing here imports torch or the rest of cudasnap.
"""
