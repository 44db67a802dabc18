"""What the prompts stage reads: the configured sources' candidates in their seeded order
(``sources``), the chat messages and identity of a record (``messages``), the packaged eval sets
(``eval_sets``), and the deterministic orders they all follow (``order``).
"""
