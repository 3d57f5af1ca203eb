"""The operations layer: what runs trainguard as processes.

One command line (:mod:`trainguard.ops.cli`, with the exit-code map of
:mod:`trainguard.ops.exits`), the demo, the service process that serves the ingest and
admin routes together (:mod:`trainguard.ops.serve`) and the GPU health daemon
(:mod:`trainguard.ops.probe`). It is the only layer that may import every part; no
part imports it.
"""
