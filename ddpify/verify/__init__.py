"""`ddpify verify`: run a DDP conversion briefly under torchrun and prove its invariants from what the ranks did.

session.py orchestrates; tracer.py runs inside the script's processes (the only module that
imports torch); launch.py starts it; invariants.py judges the traces; report.py shows them.
"""
