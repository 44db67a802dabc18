"""Helpers the tests share, one module per concern; the fixtures themselves are in tests/conftest.py.

pytest's default ``prepend`` import mode puts tests/ (which has no __init__.py) first on sys.path
when it imports conftest.py and the test modules, so they import these as ``support.<module>``;
no test module imports another.

- ``repo``: this checkout's ROOT, the test cache, the committed params, ``run`` a command.
- ``processes``: a ``dvc repro`` in its own session, the processes of a stage, killing it on cue.
- ``models``: the tiny random Llama's shape and ``model`` params, a base-model chat template, cached imports.
- ``project``: a temporary git+DVC copy of the project on the tiny verifier (the ``make_project`` fixture).
- ``pipeline``: test datasets, the fast overrides and ``-S`` lists for whole-pipeline runs.
- ``generate``, ``data``, ``merge``, ``train``, ``speculative``: inputs and calls of those stages
  on tiny data (prompts; generated records; an extract+merge repo; merged data; table drafters).
- ``tiny_drafter``: a tiny random drafter, verifier head and batch, and the ``one_thread`` autouse fixture.
- ``tiny_kimi`` and ``tokenization_tiny_kimi``: a tiny Kimi-K2.5-shaped checkpoint and its remote-code
  tokenizer (``save_pretrained`` copies that file, by its path, into the checkpoint folder).
- ``reference``: slow, literal reference implementations (attention, the TTT loss) the fast code is checked against.
- ``pixels``: read a PNG's pixels (no imaging library in the project).
- ``local_s3``: a real `eagle3 s3` server per temporary repo (the ``local_s3`` fixture), cache listings.
- ``openai_standin``: a scripted OpenAI-compatible server and SGLang launcher stand-in (also run as a script).
"""
