"""The local fleet: `modelfleet local up -f model.yaml` runs a model.yaml on one machine.

The operator's own reconcile decides what exists; this package plays the cluster around it: an in-memory
API store, a Job controller and a kubelet that run containers as local processes, and a Service proxy.
"""
