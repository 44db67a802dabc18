"""The verifier's hidden states on disk: the format extract writes (``storage``) and the dataset
training reads from it (``loader``).
"""
