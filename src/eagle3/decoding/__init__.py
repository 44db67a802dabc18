"""Speculative decoding with the drafter, and how ``evaluate`` measures it: the loop (``speculative``),
the verifier's batch and its masks (``batch``), chain and tree drafting (``tree``), CUDA-graph steps
(``graphed``), the CPU's few-row matmuls (``skinny``); the ``evaluate`` params section's schema and
the tree's shape (``config``), what evaluate reads from params (``settings``), the eval sets and the
pair of models it reads (``inputs``), what every decode of an evaluation shares (``session``), each
eval set's report (``evaluation``), the timed decoding of every method over batches and repeats
(``timing``), τ from the drafts accepted (``acceptance``), the history-only baselines, most frequent
token and prompt lookup (``baselines``), and the metrics and plots written from a report
(``report``).
"""
