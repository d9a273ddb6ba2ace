"""The trainer side of ladle.

``BatchClient`` arrives with the serving issue; this package imports only the
generated protocol (``ladle.proto``), grpcio and numpy, never ``ladle.service``.
"""
