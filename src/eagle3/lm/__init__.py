"""The verifier as a language model, as the stages use it (named apart from the ``verifier`` stage,
which writes the folder): loading the folder the verifier stage wrote (``loading``), what varies by
verifier family (``spec``), how a conversation becomes its tokens (``chat``), the verifier's
identity (``identity``) and the id of what its prompts' tokens depend on (``tokenizer_id``).
"""
