"""``kvstore bench TARGET``: one module per benchmark (helpers of a big one beside it), the shared
harness, where results go (output: printed, and written only where ``--write`` says), the
``bench`` extra (extras: matplotlib and tqdm, imported lazily), and the dispatcher (command.py)."""
