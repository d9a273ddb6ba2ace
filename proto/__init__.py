"""The gRPC contract (package ``ladle.v1``) and its generated modules.

The ``.proto`` file and the generated code arrive with the serving issue.
"""
