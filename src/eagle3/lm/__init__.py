"""The verifier as a language model, as the stages use it (named apart from the ``verifier`` stage,
which writes the folder): loading the folder the verifier stage wrote (``loading``),
what varies by verifier family (``spec``), and how a conversation becomes its tokens (``chat``).
"""
