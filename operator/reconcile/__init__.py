"""Pure decisions of the operator: spec and observed children in, desired manifests and status out.

Nothing here performs I/O; `modelfleet.operator.handlers` applies what these functions return.
"""
