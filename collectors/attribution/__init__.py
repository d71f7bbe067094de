"""Per-process series named by container and pod: cgroup paths (cgroup.py), the
kubelet's pod-resources socket (pod_resources.py), and the join (resolver.py)."""
from ac_observe.collectors.attribution.resolver import Attribution

__all__ = ["Attribution"]
