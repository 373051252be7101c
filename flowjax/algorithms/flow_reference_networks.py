"""The models whose Flow reference mode (``semantics="reference"``) is the authors' own
network, run whole rather than as departures of the paper's routed model.

Each module of ``NETWORKS`` has the same three functions: ``check_unused(config, name)``
refuses a field of the config as given that their network would ignore,
``check_config(resolved, model)`` one of the resolved config that their procedure does not
run, and ``build(model, resolved)`` returns the algorithm.
"""

from __future__ import annotations

from types import ModuleType

from flowjax.algorithms import flow_reference_lstm, flow_reference_resnet

NETWORKS: dict[str, ModuleType] = {name: module
                                   for module in (flow_reference_lstm, flow_reference_resnet)
                                   for name in module.MODELS}
