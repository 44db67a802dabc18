"""Generation backends: how the ``generate`` stage gets the verifier's answers.

A backend takes the shard's requests and calls ``done(request, result)`` once per request it
finishes, as soon as it finishes it (the stage journals each result right away). Requests whose
id is in ``finished`` were answered by an earlier, interrupted run: a backend skips them, but may
recompute them when that keeps its other results identical (the local backend re-runs a whole
batch, because a row's numerics depend on its batch-mates' padding).

- ``local``: in-process transformers on the layout's device (the embedded default);
- ``openai``: any OpenAI-compatible endpoint (SGLang, vLLM, ``transformers serve``, hosted APIs);
- ``sglang``: starts an SGLang server with the layout's TP, then talks to it as ``openai`` does.

``base`` holds what they share (requests, answers, the protocol); ``by_name.make_backend`` picks one by
name; ``shard`` answers one prompt shard through a backend, resuming from its journal (the stage's
core); ``config`` is the ``backend`` params section's schema, which every stage's view is checked with.
"""
