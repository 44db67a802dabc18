"""How the drafter is trained: the ``train`` params section and its checks (``config``), the
``merge`` section's schema, the training mixture (``mixture``), the packing and order of the
samples (``data``), the training-time-test loss (``loss``), one optimizer step and one validation
(``step``), the loop (``loop``), data-parallel processes (``parallel``), the run's identity,
checkpoints and export (``checkpoints``) and what it logs (``reporting``).
"""
