"""eagle3: EAGLE-3 draft-model training as a declarative, versioned DVC pipeline.

Each dvc.yaml stage is one module of this package run as ``python -m eagle3.<stage>``;
``common`` holds the few helpers every stage shares (errors, atomic outputs, JSONL, params).
"""

__version__ = "0.1.0"
