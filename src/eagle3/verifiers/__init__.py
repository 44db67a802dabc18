"""The verifier as the stages use it: loading the folder the verifier stage wrote (``loading``),
what varies by verifier family (``spec``), and how a conversation becomes its tokens (``chat``).
"""
