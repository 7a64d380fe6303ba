"""``kvstore bench TARGET``: one module per benchmark, the shared harness, and the dispatcher (command.py)."""
