"""The engine: a pure round (``round``), the host side of a simulation (``simulation``),
the run loop (``loop``) and its callbacks (``callbacks``). It runs whatever
``FederatedAlgorithm`` (``protocol``) it is given and never imports one.

Modules import downwards only: protocol <- round <- simulation <- callbacks <- loop.
"""
