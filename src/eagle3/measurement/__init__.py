"""How ``evaluate`` measures a drafter: what it reads from params (``settings``), the timed decoding
of every method over batches and repeats (``timing``), τ from the drafts accepted (``acceptance``)
and the history-only baselines, most frequent token and prompt lookup (``baselines``).
"""
