"""Speculative decoding with the drafter, and how ``evaluate`` measures it: the loop
(``speculative``), the verifier's batch and its masks (``batch``), chain and tree drafting
(``tree``), CUDA-graph steps (``graphed``), the CPU's few-row matmuls (``skinny``); what evaluate
reads from params (``settings``), the timed decoding of every method over batches and repeats
(``timing``), τ from the drafts accepted (``acceptance``) and the history-only baselines, most
frequent token and prompt lookup (``baselines``).
"""
