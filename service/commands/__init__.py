"""One module per ``ladle`` command: ``add_parser`` defines its arguments, ``run`` runs it.

``ladle.service.cli`` joins them into one parser. Importing any of them is
cheap (no ``datasets``, ``pyarrow`` or ``grpc``): each imports what it runs
inside ``run``, so ``ladle --help`` and an exec probe's ``ladle health``
start quickly.
"""
