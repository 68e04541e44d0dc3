"""peerinfer's sans-IO core: pure, deterministic logic with no trio, libp2p or torch import.

Nothing here awaits, reads a clock or rolls its own dice: the current time (``now``, seconds as a
float) and randomness (a ``random.Random``) are parameters. The real node (``peerinfer.net``) and
the simulator (``peerinfer.sim``) both drive exactly this code.
"""
