"""The verifier's hidden states: how extract renders the records (``samples``), runs the verifier
over them (``capture``, in several processes: ``workers``) and stores what it taps (``storage``),
and the dataset training reads from it (``loader``).
"""
