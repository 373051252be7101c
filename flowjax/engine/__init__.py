"""The engine: a pure round (``round``), the host side of a simulation (``simulation``),
the run loop (``loop``) and its callbacks (``callbacks``). It runs whatever
``FederatedAlgorithm`` it is given and never imports one.

Modules import downwards only: round <- simulation <- callbacks <- loop.
"""
