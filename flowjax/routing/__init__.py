"""Per-instance routing between a global and a local copy of a model's layers."""

from flowjax.routing.policy import RoutingPolicy, build_policy
from flowjax.routing.routed import routed_forward

__all__ = ["RoutingPolicy", "build_policy", "routed_forward"]
