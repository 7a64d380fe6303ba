"""Coverage-guided fuzzing of every decoder kvstore runs on bytes it does not control
(docs/reliability.md).

    fuzz/targets/NAME.py     one harness: ``make()`` -> check(data), ``seeds()`` -> real encodings
    fuzz/corpus/NAME/        its seed corpus, written by ``python -m fuzz seeds`` from real encodings
    fuzz/regressions/NAME/   every input that once crashed it, replayed by the test suite
    fuzz/engine.py           one atheris (libFuzzer) process over one harness
    fuzz/__main__.py         ``python -m fuzz list|seeds|run|replay`` (``make fuzz``)

A harness's ``check`` returns for every input its decoder refuses with the project's own
error, or accepts and passes the harness's checks (a value that re-encodes to the same bytes,
counters that stay consistent); anything else (another exception, a failed check, a hang, or
memory past the run's limit) is a crash, and libFuzzer keeps the input that caused it.

Nothing here is imported by kvstore, and nothing here imports kvstore at module level: the
engine imports each harness under atheris's instrumentation, so kvstore's own code is what
the coverage feedback sees.
"""
