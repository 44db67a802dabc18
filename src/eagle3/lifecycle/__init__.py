"""Where artifacts live and when they go: the DVC cache's garbage collection (``gc``) and the
S3 remote (``s3``), behind the ``eagle3 gc`` and ``eagle3 s3`` commands.
"""
