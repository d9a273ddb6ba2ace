"""The gRPC contract (package ``ladle.v1``), its generated modules and the frame codec.

- ``ladle.proto`` (the file): the messages, the service and the frame layout.
- ``ladle_pb2`` / ``ladle_pb2_grpc``: generated; ``python -m ladle.proto.generate [--check]``.
- ``codec``: encode and decode batch frames (zero-copy numpy views, validated).
- ``rpc``: method handlers and client calls that carry frames unserialized.

Nothing here imports ``ladle.service``: the client depends on this package only.
"""
